"""Compiled decode steps (torch.compile per batch bucket) give the eager engine's tokens and logprobs, and compile
in the background while the engine's steps go on.

Batches shrink across bucket boundaries as requests of different lengths finish; prompts are chunked
(a small token budget), share cached prefixes, and a small KV cache forces preemption."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import time

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.executor.decode_graphs import CPP_WRAPPER_MAX_BATCH, inductor_options
from kvforge.kernels.cpu.extension import cpu_kernels
from tests.models.test_moe_vs_transformers import build_moe_model
from tests.tiny_models import build_hybrid_model, save_model, save_tokenizer

needs_cpu_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="compiled CPU steps need the C++ CPU kernels")

BUCKETS = (1, 4, 16)  # the C++ wrapper (1) and Python's, each padding a batch that shrinks through it


def _prompts(count: int, vocab_size: int) -> list[dict]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 40))] for _ in range(count)]
    prompts[1] = prompts[0][:32] + prompts[1]  # two full cached blocks of prompts[0]
    return [{"prompt_token_ids": p} for p in prompts]


def _generate(folder: str, prompts: list[dict], params: list[SamplingParams], **options):
    """The answers of an engine of options; compiled (unless enforce_eager), every bucket is compiled first."""
    llm = LLM(folder, **options)
    if not options.get("enforce_eager"):
        graphs = llm.engine.runner.decode_graphs
        graphs.compile_ahead(graphs.max_batch)
    outputs = llm.generate(prompts, params)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _assert_same(compiled, eager) -> None:
    for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(compiled, eager, strict=True):
        assert tokens == eager_tokens
        for position, eager_position in zip(logprobs, eager_logprobs, strict=True):
            assert position.keys() == eager_position.keys()
            for token_id, entry in position.items():
                assert abs(entry.logprob - eager_position[token_id].logprob) < 1e-4


@needs_cpu_kernels
def test_compiled_llama_matches_eager_across_buckets(tiny_llama_dir) -> None:
    folder = str(tiny_llama_dir[0])
    prompts = _prompts(17, 390)
    # lengths 2..18: the batch of 17 (above the largest bucket: eager) shrinks through every bucket
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True, logprobs=3) for i in range(17)]
    options = dict(kv_cache_memory="4MiB", max_num_batched_tokens=64, compile_buckets=BUCKETS)
    llm, compiled = _generate(folder, prompts, params, **options)
    _, eager = _generate(folder, prompts, params, enforce_eager=True, **options)
    _assert_same(compiled, eager)
    graphs = llm.engine.runner.decode_graphs
    assert graphs.compiled_buckets == BUCKETS
    # small batches call their kernels from C++, the rest from Python: both match eager above
    assert graphs.wrappers == {b: "C++" if b <= CPP_WRAPPER_MAX_BATCH else "Python" for b in BUCKETS}
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_usable_blocks


@needs_cpu_kernels
def test_compiled_steps_survive_preemption(tiny_llama_dir) -> None:
    folder = str(tiny_llama_dir[0])
    prompts = _prompts(6, 390)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 7 blocks of 16 tokens for 6 sequences of up to ~80 tokens: the scheduler must preempt
    options = dict(kv_cache_memory=7 * 16 * 2 * 2 * 2 * 16 * 4 + 1, compile_buckets=(4, 8))
    llm, compiled = _generate(folder, prompts, [params] * 6, **options)
    _, eager = _generate(folder, prompts, [params] * 6, enforce_eager=True, **options)
    assert [t for t, _ in compiled] == [t for t, _ in eager]
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.runner.decode_graphs.compiled_buckets


@needs_cpu_kernels
def test_buckets_compiled_ahead_write_no_cache_and_replay_the_eager_tokens(tiny_llama_dir) -> None:
    folder = str(tiny_llama_dir[0])
    prompts = _prompts(2, 390)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = dict(kv_cache_memory="4MiB", compile_buckets=(2, 4))
    llm = LLM(folder, compile_after=4, **options)
    runner = llm.engine.runner
    caches = [tensor.clone() for layer in runner.kv_caches for tensor in layer]
    runner.decode_graphs.compile_ahead(2)
    assert runner.decode_graphs.compiled_buckets == (2,)
    assert all(torch.equal(a, b) for a, b in zip(caches, (t for layer in runner.kv_caches for t in layer)))
    compiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    _, eager = _generate(folder, prompts, [params] * 2, enforce_eager=True, **options)
    assert compiled == [t for t, _ in eager]


@needs_cpu_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_compiled_steps_write_and_read_a_quantized_cache(tiny_llama_dir, kv_cache_dtype: str) -> None:
    folder = str(tiny_llama_dir[0])
    prompts = _prompts(3, 390)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 9, 12)]
    # the last request decodes alone: bucket 1, whose C++ wrapper passes the cache's scales to the C entry points
    options = dict(kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype, compile_buckets=(1, 4))
    llm, compiled = _generate(folder, prompts, params, **options)
    _, eager = _generate(folder, prompts, params, enforce_eager=True, **options)
    assert [t for t, _ in compiled] == [t for t, _ in eager]
    assert llm.engine.runner.decode_graphs.wrappers == {1: "C++", 4: "Python"}


# NOTE: mistral's layers are llama's (test_compiled_llama_matches_eager_across_buckets); qwen2's are qwen3's without the
# QK-norm and with biases: slow
@pytest.fixture(scope="module",
                params=[pytest.param("qwen2", marks=pytest.mark.slow), "qwen3", "mixtral", "deepseek_v3"])
def tiny_folder(request, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(f"compiled-{request.param}")
    if request.param in ("mixtral", "deepseek_v3"):
        build_moe_model(request.param, save_tokenizer(folder)).save_pretrained(folder)
    else:
        save_model(folder, request.param)
    return str(folder)


@needs_cpu_kernels
def test_compiled_families_match_eager(tiny_folder: str) -> None:
    """NOTE: DeepSeek's latent attention syncs the host on the CPU (its decode reference sizes the gathered
    context by the longest sequence): it cannot be traced, and its decode steps run eagerly, unchanged."""
    prompts = _prompts(3, 300)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (4, 7, 9)]
    options = dict(kv_cache_memory="4MiB", compile_buckets=(1, 4))  # 1: the C++ wrapper, 4: Python's
    llm, compiled = _generate(tiny_folder, prompts, params, **options)
    _, eager = _generate(tiny_folder, prompts, params, enforce_eager=True, **options)
    _assert_same(compiled, eager)
    traced = "deepseek" not in tiny_folder
    assert llm.engine.runner.decode_graphs.compiled_buckets == ((1, 4) if traced else ())


# NOTE: each family's compile takes 20-40 s: slow (the default suite runs the hybrid and windowed models eagerly)
@pytest.fixture(scope="module", params=[pytest.param("gemma3", marks=pytest.mark.slow),
                                        pytest.param("gpt_oss", marks=pytest.mark.slow),
                                        pytest.param("qwen3_5", marks=pytest.mark.slow)])
def layer_groups_folder(request, tmp_path_factory) -> str:
    """Gemma 3 and GPT-OSS: a full-attention and sliding-window groups (windows of 8; GPT-OSS's sinks); Qwen3.5: full
    attention and linear-attention states."""
    folder = tmp_path_factory.mktemp(f"compiled-{request.param}")
    if request.param == "qwen3_5":
        build_hybrid_model("qwen3_5", save_tokenizer(folder)).save_pretrained(folder)
    else:
        save_model(folder, request.param)
    return str(folder)


@needs_cpu_kernels
def test_compiled_layer_groups_match_eager(layer_groups_folder: str) -> None:
    """A model of several layer groups compiles its decode step with every group's slot mapping and block tables (and
    the requests' state slots) as inputs: 3, then 2, then 1 request run in bucket 4, whose padding rows write no
    request's cache or state, with the eager engine's tokens and logprobs (prompts past Gemma's window of 8)."""
    prompts = _prompts(3, 300)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (4, 7, 9)]
    options = dict(kv_cache_memory="4MiB", compile_buckets=(4,), max_num_seqs=8)
    llm, compiled = _generate(layer_groups_folder, prompts, params, **options)
    _, eager = _generate(layer_groups_folder, prompts, params, enforce_eager=True, **options)
    _assert_same(compiled, eager)
    assert llm.engine.runner.decode_graphs.compiled_buckets == (4,)
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_usable_blocks


@needs_cpu_kernels
def test_the_kernels_build_keys_the_compiled_steps_on_the_cpu_only() -> None:
    """Inductor's cache keys a graph on its code, which names an op but not the build of it: the build's name joins
    the key as the id of a pass that leaves the graph as it is."""
    options = inductor_options(torch.device("cpu"), cpp_wrapper=True)
    build = options["post_grad_custom_post_pass"]
    assert build.uuid() == cpu_kernels().__name__
    graph = torch.fx.symbolic_trace(lambda x: x * 2 + 1).graph
    before = str(graph)
    build(graph)
    assert str(graph) == before
    assert options["cpp_wrapper"] and "post_grad_custom_post_pass" not in inductor_options(torch.device("cuda"), False)


@needs_cpu_kernels
def test_the_cpp_wrapper_gets_the_kernels_c_entry_points_in_a_cacheable_form() -> None:
    """The ops a decode step calls are declared to Inductor with their C entry points (kernels/cpu/bindings.py:
    c_shim), keyed so that Inductor finds each op there and can pickle its configuration (or it would cache no
    graph)."""
    shims = inductor_options(torch.device("cpu"), cpp_wrapper=True)["aot_inductor.custom_ops_to_c_shims"]
    ops = torch.ops.kvforge_cpu
    for op in (ops.quant_gemm_panels.default, ops.paged_decode.default, ops.cache_write.default):
        assert op in shims and shims[op][0].startswith(f"AOTITorchError aoti_torch_cpu_{op._opname}(")
    assert pickle.loads(pickle.dumps(shims)) == shims
    assert "aot_inductor.custom_ops_to_c_shims" not in inductor_options(torch.device("cpu"), cpp_wrapper=False)


@pytest.mark.gpu
def test_cuda_graphs_replay_the_eager_tokens(tiny_llama_dir) -> None:
    """On a GPU each bucket's compiled step is captured as a CUDA/HIP graph and replayed."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm device")
    folder = str(tiny_llama_dir[0])
    prompts = _prompts(5, 390)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=2) for i in range(5)]
    options = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", compile_buckets=(1, 2, 4, 8))
    llm, compiled = _generate(folder, prompts, params, **options)
    _, eager = _generate(folder, prompts, params, enforce_eager=True, **options)
    _assert_same(compiled, eager)
    assert llm.engine.runner.decode_graphs.compiled_buckets == (1, 2, 4, 8)


@pytest.mark.gpu
def test_cuda_graphs_of_layer_groups_replay_the_eager_tokens(layer_groups_folder: str) -> None:
    """On a GPU a model of several layer groups (Gemma 3's windows, Qwen3.5's states) captures and replays its buckets
    as well, the Triton kernels writing the padding rows' states into the padding slot."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm device")
    prompts = _prompts(3, 300)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (4, 7, 9)]
    options = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", compile_buckets=(2, 4), max_num_seqs=8)
    llm, compiled = _generate(layer_groups_folder, prompts, params, **options)
    _, eager = _generate(layer_groups_folder, prompts, params, enforce_eager=True, **options)
    _assert_same(compiled, eager)
    assert llm.engine.runner.decode_graphs.compiled_buckets == (2, 4)


def _rounds_until_compiled(llm: LLM, prompts: list[dict], params: SamplingParams, bucket: int) -> list[tuple]:
    """Generate prompts again and again, a moment apart (the engine idles: the compile runs freely meanwhile), until
    a round began with bucket compiled: [(answers, seconds, compiled when the round began)]. While it is not, no other
    bucket compiles."""
    graphs = llm.engine.runner.decode_graphs
    start = time.monotonic()
    rounds = []
    while not rounds or not rounds[-1][2]:
        assert time.monotonic() < start + 600, "the bucket did not compile"
        compiled, began = bucket in graphs.compiled_buckets, time.monotonic()
        answers = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        rounds.append((answers, time.monotonic() - began, compiled))
        if not compiled:
            # NOTE: a compile that ended after the round's last decode step is swapped in at the next one
            assert set(graphs.compiled_buckets) <= {bucket} and graphs.num_compiling <= 1
            time.sleep(0.5)
    return rounds


@needs_cpu_kernels
@pytest.mark.parametrize("speculative_method", [None, "ngram"])
def test_a_bucket_compiles_in_the_background_while_its_steps_run_eagerly(tiny_llama_dir, speculative_method) -> None:
    """A bucket's first decode step (compile_after=0) starts its compile on another thread and runs eagerly, as do
    the steps after it until the graph is swapped in between two steps: a generation does not wait for the compile,
    and its answers equal the eager engine's before, during and after the swap. With n-gram speculation the bucket
    is the verification steps' (4 drafts + 1 rows: the bucket of 5)."""
    folder = str(tiny_llama_dir[0])
    if speculative_method is None:
        prompts, bucket, options = _prompts(2, 390), 2, dict(compile_buckets=(2,))
    else:
        prompts, bucket = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 8}], 5
        options = dict(compile_buckets=(8,), speculative_method="ngram", num_speculative_tokens=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(folder, kv_cache_memory="4MiB", compile_after=0, **options)
    assert bucket in llm.engine.runner.decode_graphs.buckets
    rounds = _rounds_until_compiled(llm, prompts, params, bucket)
    compile_seconds = sum(seconds + 0.5 for _, seconds, compiled in rounds if not compiled)  # at most
    assert rounds[0][1] < compile_seconds / 2, [seconds for _, seconds, _ in rounds]
    _, eager = _generate(folder, prompts, [params] * len(prompts), enforce_eager=True, kv_cache_memory="4MiB")
    assert all(answers == [tokens for tokens, _ in eager] for answers, _, _ in rounds)
    if speculative_method is not None:
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


@needs_cpu_kernels
@pytest.mark.parametrize("shutdown", [True, False])
def test_an_engine_ends_while_its_buckets_compile(tiny_llama_dir, tmp_path, shutdown: bool) -> None:
    """Shut down (or just left at exit) while every bucket compiles from a cold Inductor cache, an engine's process
    ends within seconds: the queued compiles are dropped and the running one stops at its next Python call (or is
    left to its C++ compiler on a daemon thread)."""
    script = f"""
import time
from kvforge import LLM
llm = LLM({str(tiny_llama_dir[0])!r}, kv_cache_memory="4MiB", compile_buckets=(1, 2, 4), compile_at_start=True)
time.sleep(2)
assert llm.engine.num_compiling() > 0
print("ending", flush=True)
if {shutdown}:
    llm.shutdown()
"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ending\n"
    ending = time.monotonic()
    assert process.wait(timeout=120) == 0
    assert time.monotonic() - ending < 30
