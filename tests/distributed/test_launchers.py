"""The ways users start a parallel engine: `kvforge generate|serve --tensor-parallel-size 2`, and torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from kvforge import LLM, SamplingParams
from kvforge.cli import main
from tests.server.harness import free_port

PROMPT = "Paris is the capital"
ARGS = ["--raw", "--max-tokens", "8", "--ignore-eos", "--kv-cache-memory", "16MiB"]


def _reference(folder: Path) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return LLM(str(folder), kv_cache_memory="16MiB").generate([PROMPT], params)[0].outputs[0].text


def test_generate_command_with_tensor_parallel(tiny_llama_dir, capsys) -> None:
    folder = tiny_llama_dir[0]
    want = _reference(folder)
    assert main(["generate", PROMPT, "--model", str(folder), *ARGS, "--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_torchrun_starts_the_ranks(tiny_llama_dir, tmp_path) -> None:
    """The multi-node path on one node: torchrun starts both ranks; rank 0 prints, rank 1 serves it."""
    folder = tiny_llama_dir[0]
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "kvforge.cli", "--log-level", "WARNING",
               "generate", PROMPT, "--model", str(folder), *ARGS, "--pipeline-parallel-size", "2",
               "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == _reference(folder) + "\n"


# A user's script as many are written: no `if __name__ == "__main__":` guard. Ranks started by
# re-importing __main__ (multiprocessing's spawn) would each build the engine again and die.
NO_GUARD_SCRIPT = """
import sys
from kvforge import LLM, SamplingParams

params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
for split in ({}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
    llm = LLM(sys.argv[1], kv_cache_memory="16MiB", **split)
    print(repr(llm.generate([sys.argv[2]], params)[0].outputs[0].text), flush=True)
    llm.shutdown()
"""


def test_a_script_without_a_main_guard_runs_parallel(tiny_llama_dir, tmp_path) -> None:
    folder = tiny_llama_dir[0]
    script = tmp_path / "generate.py"
    script.write_text(NO_GUARD_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, str(script), str(folder), PROMPT], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [repr(_reference(folder))] * 3  # one process, TP=2, PP=2


def test_serve_command_with_tensor_parallel(tiny_llama_dir) -> None:
    folder = tiny_llama_dir[0]
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "kvforge.cli", "serve", "--model", str(folder), "--port", str(port),
         "--kv-cache-memory", "16MiB", "--tensor-parallel-size", "2", "--served-model-name", "tiny"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert completion.choices[0].text == _reference(folder)
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_server_streams_under_pipeline_parallel(tiny_llama_dir) -> None:
    """Streams with micro-batches in flight; clients that hang up midway are aborted while their step
    may still be in flight, the others get the greedy text, and every KV block is free afterwards."""
    import asyncio

    from tests.server.harness import API_KEY, MODEL_NAME, start_tiny_server, wait_idle

    folder = tiny_llama_dir[0]
    prompts = [f"{word} is the capital" for word in ("Paris", "Berlin", "Rome", "Madrid", "Oslo", "Lima")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(str(folder), kv_cache_memory="64MiB").generate(prompts, params)]
    server = start_tiny_server(folder, pipeline_parallel_size=2)

    async def stream(prompt: str, hang_up: bool) -> str:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
        chunks = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text = ""
        async for chunk in chunks:
            text += chunk.choices[0].text
            if hang_up and len(text) > 0:
                await chunks.close()
                break
        await client.close()
        return text

    async def run_all() -> list[str]:
        return await asyncio.gather(*(stream(p, hang_up=i % 3 == 2) for i, p in enumerate(prompts * 2)))

    try:
        got = asyncio.run(run_all())
        wait_idle(server.http)
    finally:
        server.stop()
        server.engine.engine.shutdown()
    for i, text in enumerate(got):
        if i % 3 != 2:
            assert text == want[i % len(prompts)]
