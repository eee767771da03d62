"""Past one machine, on hosts made of network namespaces (tests/netns_hosts.py): torchrun with one rank per host
(TP=2, PP=2) gives the single-process tokens, and the router reaches replicas on two other hosts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams
from tests.netns_hosts import NamespaceHosts

pytestmark = pytest.mark.slow

PROMPT = "Paris is the capital"
ARGS = ["--raw", "--max-tokens", "8", "--ignore-eos", "--kv-cache-memory", "16MiB", "--device", "cpu"]
MASTER_PORT = "29533"


@pytest.fixture(autouse=True)
def _namespaces_possible() -> None:
    NamespaceHosts.skip_unless_possible()


def _reference(folder: Path) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), kv_cache_memory="16MiB")
    try:
        return llm.generate([PROMPT], params)[0].outputs[0].text
    finally:
        llm.shutdown()


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_torchrun_one_rank_per_host(tiny_llama_dir, tmp_path, split: str) -> None:
    folder = tiny_llama_dir[0]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with NamespaceHosts(2) as hosts:
        ranks = []
        for node in range(2):
            command = [torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                       "--master-addr", hosts.address(0), "--master-port", MASTER_PORT, "-m", "kvforge.cli",
                       "--log-level", "WARNING", "generate", PROMPT, "--model", str(folder), *ARGS, split, "2"]
            ranks.append(hosts.popen(node, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=tmp_path))
        outputs = [rank.communicate(timeout=300) for rank in ranks]
        for rank, (_, stderr) in zip(ranks, outputs):
            assert rank.returncode == 0, stderr[-3000:]
    assert outputs[0][0] == _reference(folder) + "\n"  # node 0 holds rank 0, which prints
    assert outputs[1][0] == ""


# Run on the router's host: wait for both replicas, then send two system prompts' questions through the router
# and each prompt once straight to each replica; print what a user sees.
CLIENT = """
import json, sys, time
import httpx, openai
router, replicas = sys.argv[1], sys.argv[2:]
deadline = time.monotonic() + 300
while True:
    try:
        if httpx.get(router + "/health").json().get("healthy_replicas") == len(replicas):
            break
    except (httpx.TransportError, ValueError):
        pass
    assert time.monotonic() < deadline, "the replicas did not come up"
    time.sleep(0.5)
client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
prompts = [f"{system} Question {q}:" for system in ("You are a pirate captain, arr. " * 4,
                                                   "You are a quiet librarian. " * 4) for q in range(3)]
routed = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0).choices[0].text
          for p in prompts]
direct = [[openai.OpenAI(base_url=url + "/v1", api_key="none").completions.create(
    model="tiny", prompt=p, max_tokens=4, temperature=0).choices[0].text for p in prompts] for url in replicas]
metrics = httpx.get(router + "/metrics").text
requests = [float(line.split()[-1]) for url in replicas for line in metrics.splitlines()
            if line.startswith(f'kvforge_router:replica_requests_total{{replica="{url}"}}')]
print(json.dumps({"routed": routed, "direct": direct, "requests": requests}))
"""


def test_router_with_replicas_on_two_hosts(tiny_llama_dir) -> None:
    folder = str(tiny_llama_dir[0])
    with NamespaceHosts(3) as hosts:
        urls = [f"http://{hosts.address(host)}:8000" for host in (1, 2)]
        processes = [hosts.popen(host, [sys.executable, "-m", "kvforge.cli", "serve", folder, "--host",
                                        hosts.address(host), "--port", "8000", "--served-model-name", "tiny",
                                        "--enforce-eager", "--kv-cache-memory", "32MiB"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for host in (1, 2)]
        router_command = [sys.executable, "-m", "kvforge.cli", "router", "--host", hosts.address(0), "--port", "9000",
                          "--health-interval", "0.5"] + [part for url in urls for part in ("--backend", url)]
        processes.append(hosts.popen(0, router_command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True))
        try:
            time.sleep(1)
            done = hosts.run_python(0, CLIENT, f"http://{hosts.address(0)}:9000", *urls)
            assert done.returncode == 0, done.stderr[-3000:]
        finally:
            for process in processes:
                process.terminate()
            errors = [process.communicate(timeout=60)[1] for process in processes]
    seen = json.loads(done.stdout)
    assert seen["routed"] == seen["direct"][0] == seen["direct"][1], errors
    assert sorted(seen["requests"]) == [3, 3]  # each system prompt's questions on one replica
