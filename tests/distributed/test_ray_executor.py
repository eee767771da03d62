"""`--distributed-executor-backend ray`: the ranks as Ray actors give the single-process tokens, on a local Ray
cluster the engine starts (TP=2) and on an existing cluster whose head and worker are two network-namespace hosts
(PP=2, the second stage placed on the worker host)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams
from tests.netns_hosts import NamespaceHosts

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

PROMPT = "Paris is the capital"
# The engine on Ray as a user's script builds it: argv = model folder, split option, Ray address or "".
SCRIPT = """
import sys
from kvforge import LLM, SamplingParams

params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
llm = LLM(sys.argv[1], kv_cache_memory="16MiB", distributed_executor_backend="ray", ray_address=sys.argv[3] or None,
          **{sys.argv[2]: 2})
print(repr(llm.generate([sys.argv[4]], params)[0].outputs[0].text), flush=True)
llm.shutdown()
"""
RAY = str(Path(sys.executable).parent / "ray")
# Ray clusters started by `ray start` ask for its token (in ~/.ray); the engine and every node use it.
RAY_ENV = {"RAY_AUTH_MODE": "token"}


def _reference(folder: Path) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), kv_cache_memory="16MiB")
    try:
        return repr(llm.generate([PROMPT], params)[0].outputs[0].text)
    finally:
        llm.shutdown()


def test_tensor_parallel_on_a_local_ray_cluster(tiny_llama_dir, tmp_path) -> None:
    folder = tiny_llama_dir[0]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(Path(__file__).parents[2]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), "tensor_parallel_size", "", PROMPT],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [_reference(folder)]


def _stop(process: subprocess.Popen) -> None:
    process.terminate()  # `ray start --block` stops the node's processes on SIGTERM
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_pipeline_stages_on_a_head_and_a_worker_host(tiny_llama_dir) -> None:
    NamespaceHosts.skip_unless_possible()
    folder = tiny_llama_dir[0]
    with NamespaceHosts(2) as hosts:
        head_address = f"{hosts.address(0)}:6379"
        # the head offers no CPUs: the second stage's actor must go to the worker host
        head = hosts.popen(0, [RAY, "start", "--head", "--block", "--node-ip-address", hosts.address(0), "--port",
                               "6379", "--num-cpus", "0", "--include-dashboard", "false"], env=RAY_ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        nodes = [head]
        try:
            time.sleep(5)
            nodes.append(hosts.popen(1, [RAY, "start", "--block", "--address", head_address, "--node-ip-address",
                                         hosts.address(1), "--num-cpus", "1"], env=RAY_ENV,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(5)
            done = hosts.run_python(0, SCRIPT, str(folder), "pipeline_parallel_size", head_address, PROMPT,
                                    env=RAY_ENV)
        finally:
            for node in reversed(nodes):
                _stop(node)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [_reference(folder)]
    assert f"ip={hosts.address(1)}" in done.stderr  # the stage-1 actor ran on the worker host
