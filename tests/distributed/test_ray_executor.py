"""Ray across hosts. `--distributed-executor-backend ray`: the ranks as Ray actors give the single-process tokens,
on a local Ray cluster the engine starts (TP=2) and on an existing cluster whose head and worker are two
network-namespace hosts (PP=2, the second stage placed on the worker host). `kvforge serve --data-parallel-size 2
--data-parallel-backend ray` on that cluster: one replica actor per host (STRICT_SPREAD), the router on the head
host reaching both, the single engine's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams
from tests.netns_hosts import NamespaceHosts

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

PROMPT = "Paris is the capital"
PROMPTS = [PROMPT, "The quick brown fox"]
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


@contextmanager
def _ray_cluster(hosts: NamespaceHosts, head_cpus: int) -> Iterator[str]:
    """A Ray head on host 0 offering `head_cpus` CPUs and a worker on host 1 offering one; the head's address."""
    head_address = f"{hosts.address(0)}:6379"
    head = hosts.popen(0, [RAY, "start", "--head", "--block", "--node-ip-address", hosts.address(0), "--port",
                           "6379", "--num-cpus", str(head_cpus), "--include-dashboard", "false"], env=RAY_ENV,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nodes = [head]
    try:
        time.sleep(5)
        nodes.append(hosts.popen(1, [RAY, "start", "--block", "--address", head_address, "--node-ip-address",
                                     hosts.address(1), "--num-cpus", "1"], env=RAY_ENV,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(5)
        yield head_address
    finally:
        for node in reversed(nodes):
            _stop(node)


def test_pipeline_stages_on_a_head_and_a_worker_host(tiny_llama_dir) -> None:
    NamespaceHosts.skip_unless_possible()
    folder = tiny_llama_dir[0]
    with NamespaceHosts(2) as hosts:
        # the head offers no CPUs: the second stage's actor must go to the worker host
        with _ray_cluster(hosts, head_cpus=0) as head_address:
            done = hosts.run_python(0, SCRIPT, str(folder), "pipeline_parallel_size", head_address, PROMPT,
                                    env=RAY_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    # NOTE: the last line: Ray's autoscaler may print to the driver's stdout while the worker node joins
    assert done.stdout.splitlines()[-1:] == [_reference(folder)]
    assert f"ip={hosts.address(1)}" in done.stderr  # the stage-1 actor ran on the worker host


# Run on the head host: wait until the router has both replicas in, send each prompt through it, print the answers
# and the requests each replica got (by URL) as the router's /metrics counts them.
CLIENT = """
import json, sys, time
import httpx, openai
router = sys.argv[1]
deadline = time.monotonic() + 300
while True:
    try:
        if httpx.get(router + "/health").json().get("healthy_replicas") == 2:
            break
    except (httpx.TransportError, ValueError):
        pass
    assert time.monotonic() < deadline, "the replicas did not come up"
    time.sleep(0.5)
client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
texts = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text for prompt in sys.argv[2:]]
requests = {line.split('"')[1]: float(line.split()[-1]) for line in httpx.get(router + "/metrics").text.splitlines()
            if line.startswith("kvforge_router:replica_requests_total{")}
print(json.dumps({"texts": texts, "requests": requests}))
"""


def test_data_parallel_replicas_one_per_host(tiny_llama_dir) -> None:
    NamespaceHosts.skip_unless_possible()
    folder = tiny_llama_dir[0]
    with NamespaceHosts(2) as hosts:
        # each host offers one CPU, each replica's bundle holds one: STRICT_SPREAD puts one on each host
        with _ray_cluster(hosts, head_cpus=1) as head_address:
            router = f"http://{hosts.address(0)}:9000"
            serve = hosts.popen(0, [sys.executable, "-m", "kvforge.cli", "serve", str(folder), "--data-parallel-size",
                                    "2", "--data-parallel-backend", "ray", "--data-parallel-placement",
                                    "STRICT_SPREAD", "--ray-address", head_address, "--host", hosts.address(0),
                                    "--port", "9000", "--served-model-name", "tiny", "--enforce-eager",
                                    "--kv-cache-memory", "32MiB", "--health-interval", "0.5"],
                                env=RAY_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                done = hosts.run_python(0, CLIENT, router, *PROMPTS, env=RAY_ENV)
            finally:
                serve.terminate()
                errors = serve.communicate(timeout=120)[1]
    assert done.returncode == 0, done.stderr[-3000:] + errors[-3000:]
    seen = json.loads(done.stdout)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), kv_cache_memory="16MiB")
    try:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()
    assert seen["texts"] == expected
    # the prompts share no prefix: the router spread them, one to each replica, and there is one replica per host
    assert sorted(seen["requests"].values()) == [1, 1]
    assert sorted(url.split("//")[1].split(":")[0] for url in seen["requests"]) == [hosts.address(0),
                                                                                   hosts.address(1)]
