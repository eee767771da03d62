"""Decode steps compiled once per batch bucket and replayed: torch.compile (Inductor), plus a CUDA/HIP graph
of each bucket on GPUs.

A decode-only step of n sequences runs the graph of the smallest bucket b >= n, once that bucket has run
`compile_after` steps eagerly (so that a short generation does not wait for a compile). Its inputs live in static
buffers sized for the largest bucket, updated in place each step; rows n..b-1 are padding that writes no
cache slot and attends to nothing:

    row              0 .. n-1 (the step's sequences)        n .. b-1 (padding)
    input_ids        the new tokens                           0
    positions        their positions                          0
    slot_mapping     where their keys and values go           -1     (the cache write skips it)
    seq_lens         context lengths                          0      (attention outputs zeros)
    block_tables     [n, max_blocks] rows of the step         stale rows, never read (seq_len 0)

Each bucket's graph (model forward + LM head: fp32 logits [b, vocab]) is compiled with static shapes on the
first step that needs it; norms, rotary, SiLU-and-mul and residual adds fuse, while the cache write,
attention and quantized matmuls stay opaque ops. Since its inputs (the static buffers, the caches and the
parameters) are the same tensors every step, a replay calls Inductor's graph on them directly: dynamo runs
only to compile. On the CPU, the graphs of small batches call their kernels from Inductor's C++ wrapper, the
others from its Python one. Inductor's on-disk caches make a second start of the same model compile nothing new.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections.abc import Callable

import torch
from torch import nn

from kvforge.kernels.cpu.extension import c_shims, cpu_kernels
from kvforge.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# NOTE: on the CPU, graphs of up to this many sequences get Inductor's C++ wrapper: it calls the kernels and the
# opaque ops from C++, where Python's wrapper spends a few microseconds an op (~330 calls a step of the default
# model). Measured on the default model with the GGUF weights (Xeon VNNI VM, 2 threads, processes in turn):
# batch 1, 123-125 -> 134-158 tokens/s; batch 4, 309-328 -> 307-341 (noise). A cold compile of a bucket takes
# 37-41 -> 97-108 s, a warm one (Inductor's on-disk cache) 9 s either way.
CPP_WRAPPER_MAX_BATCH = 1


def _kernels_build(build: str) -> object:
    """A pass that changes nothing, whose id names the build of the C++ CPU kernels (kernels/cpu/extension.py).
    Inductor keys its on-disk cache on a graph's code, which names the ops it calls but not their builds, and leaves
    out arguments equal to their defaults: a graph compiled against an op's older argument list would be reused
    (and crash) once a new argument with a default joins it. A custom pass's id joins the key. NOTE: Inductor is
    imported here, not with this module: it adds ~1.1 s to an engine's start that compiles nothing."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class KernelsBuild(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            pass

        def uuid(self) -> str:
            return build

    return KernelsBuild()


def inductor_options(device: torch.device, cpp_wrapper: bool) -> dict[str, object]:
    """The Inductor configuration a decode step compiles with: shape and alignment asserts off (the inputs are
    static, and the opaque ops' fake implementations are tested against the kernels; measured: ~1.5 ms a step of the
    default model), the C++ or the Python wrapper, and on the CPU the kernels' build in the cache key and, for the
    C++ wrapper, their C entry points (csrc/c_shims.cpp), which it then calls instead of the dispatcher."""
    options: dict[str, object] = dict(size_asserts=False, alignment_asserts=False, cpp_wrapper=cpp_wrapper)
    if device.type == "cpu" and cpu_kernels() is not None:
        options["post_grad_custom_post_pass"] = _kernels_build(cpu_kernels().__name__)
        if cpp_wrapper:
            options["aot_inductor.custom_ops_to_c_shims"] = c_shims()
    return options


class DecodeGraphs:
    """The compiled decode step of one model runner: `run` takes a decode-only step of at most
    `max_batch` sequences and returns its logits [num_seqs, vocab]."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, ...]], buckets: tuple[int, ...],
                 compile_after: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.compile_after = compile_after
        self._eager_steps = dict.fromkeys(buckets, 0)  # bucket -> decode steps it ran eagerly
        self.kv_caches = kv_caches
        self.buckets = buckets
        self.max_batch = buckets[-1]
        self.device = device
        size = self.max_batch
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._compiled: Callable[..., torch.Tensor] | None = None  # _step under torch.compile, made by the first build
        self._graph: tuple[Callable[..., list[torch.Tensor]], list[torch.Tensor]] | None = None  # the last compiled
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}  # bucket -> its ready graph
        self._building = 0  # the bucket being compiled
        self.wrappers: dict[int, str] = {}  # bucket -> the wrapper Inductor built for its graph: "C++" or "Python"
        self.failed = False  # a bucket could not be compiled: every step runs eagerly from then on

    @property
    def compiled_buckets(self) -> tuple[int, ...]:
        """The buckets whose graphs are ready."""
        return tuple(sorted(self._replays))

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding num_seqs sequences; None above the largest (or after a failed compile)."""
        return None if self.failed else next((b for b in self.buckets if b >= num_seqs), None)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    def _compiled_step(self) -> Callable[..., torch.Tensor]:
        """_step under torch.compile, called with self (not bound to it: no reference cycle). NOTE: made when the first
        bucket compiles, not with the engine: torch.compile imports dynamo (~1 s of CPU time), which an engine that
        compiles nothing, or not yet, need not wait for. torch.compile keeps its graphs (and its recompile count) on
        the code object of the function it compiles: a copy of _step's code per instance keeps each engine's buckets
        apart from other engines'."""
        step = types.FunctionType(DecodeGraphs._step.__code__.replace(), globals(), "_step")
        return torch.compile(step, fullgraph=True, dynamic=False, backend=_WeakBackend(self))

    def _metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket], decode_only=True)

    def _build(self, bucket: int) -> Callable[[], torch.Tensor]:
        """Compile (and on GPUs capture) the bucket's step; returns what replays it on the static buffers."""
        start = time.perf_counter()
        metadata = self._metadata(bucket)
        ids, positions = self.input_ids[:bucket], self.positions[:bucket]
        # NOTE: one graph per bucket of one compiled function: allow as many recompiles as there are buckets
        self._building = bucket  # for the backend, which dynamo calls with the graph alone
        if self._compiled is None:
            self._compiled = self._compiled_step()
        with torch._dynamo.config.patch(recompile_limit=len(self.buckets), accumulated_recompile_limit=10**6):
            self._compiled(self, ids, positions, metadata)
        assert self._graph is not None, "dynamo ran the bucket's step without compiling it"
        graph, inputs = self._graph
        self._graph = None

        def replay() -> torch.Tensor:
            # NOTE: every step passes the same static buffers, caches and parameters, which are the graph's
            # inputs: the compiled graph is called on them directly, without dynamo's frame (guards and
            # gathering ~490 tensors from the model: ~2.5 ms a step of the default model, 2-core EPYC).
            return graph(*inputs)[0]

        if self.device.type == "cuda":
            replay = _capture(replay, self.device)
        logger.info("compiled the decode step for batch %d in %.1f s (%s wrapper)", bucket,
                    time.perf_counter() - start, self.wrappers[bucket])
        return replay

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
            ) -> torch.Tensor | None:
        """input_ids, positions [n]; metadata of a decode-only step of n <= max_batch sequences -> logits
        [n, vocab]; None (nothing ran) while the bucket is not compiled yet, or when the model cannot be
        compiled: the caller runs the step eagerly."""
        num_seqs = input_ids.shape[0]
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None and metadata.decode_only
        if bucket not in self._replays and self._eager_steps[bucket] < self.compile_after:
            self._eager_steps[bucket] += 1
            return None
        width = metadata.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        self._pad(num_seqs, bucket)  # padding rows: the previous step's values may linger there
        replay = self._replays.get(bucket) or self._compile(bucket)
        return None if replay is None else replay()[:num_seqs]

    @torch.inference_mode()  # as the runner's steps run: a graph compiled outside it would not match them
    def compile_ahead(self, max_seqs: int) -> None:
        """Compile now every bucket of at most max_seqs sequences that is not compiled yet (a benchmark's
        warm-up: no compile then falls in its timed part). Each runs once on padding rows, which write no
        cache slot and attend to nothing."""
        for bucket in self.buckets:
            if bucket <= max_seqs and bucket not in self._replays and not self.failed:
                self._pad(0, bucket)
                self._compile(bucket)

    def _pad(self, start: int, end: int) -> None:
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(-1)
        self.seq_lens[start:end].zero_()

    def _inductor(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
                  ) -> Callable[..., list[torch.Tensor]]:
        """The torch.compile backend: Inductor (inductor_options), keeping what it compiled and the tensors it
        took (the replays pass the same ones). Small CPU batches get the C++ wrapper (CPP_WRAPPER_MAX_BATCH), or
        Python's where it cannot be built."""
        from torch._inductor.compile_fx import compile_fx

        # dynamo raises what a backend raises as BackendCompilerFailed: the engine then runs eagerly
        if not all(isinstance(t, torch.Tensor) for t in example_inputs):
            raise TypeError("a decode step's graph takes tensors only (static shapes)")
        if len(graph.graph.output_node().args[0]) != 1:
            raise TypeError("a decode step's graph returns its logits only")
        batch = self._building
        wrappers = ("C++", "Python") if self.device.type == "cpu" and batch <= CPP_WRAPPER_MAX_BATCH else ("Python",)
        for wrapper in wrappers:
            try:
                with torch._inductor.config.patch(inductor_options(self.device, wrapper == "C++")):
                    compiled = compile_fx(graph, example_inputs)
                self.wrappers[batch] = wrapper
                break
            except Exception as err:  # noqa: BLE001 -- the Python wrapper compiles whatever Inductor compiles
                if wrapper == wrappers[-1]:
                    raise
                logger.warning("cannot build the C++ wrapper of the decode step for batch %d (%s); using Python's",
                               batch, str(err).splitlines()[0] if str(err) else type(err).__name__)
        self._graph = compiled, list(example_inputs)
        return compiled

    def _compile(self, bucket: int) -> Callable[[], torch.Tensor] | None:
        """The bucket's replay, compiled now; None (and every step eager from then on) if it cannot be."""
        try:
            replay = self._replays[bucket] = self._build(bucket)
        except torch._dynamo.exc.TorchDynamoException as err:  # raised while tracing: nothing has run
            logger.warning("cannot compile the decode step of %s (%s); running it eagerly",
                           type(self.model).__name__, str(err).splitlines()[0])
            self.failed = True
            return None
        return replay


class _WeakBackend:
    """The torch.compile backend of one DecodeGraphs: its `_inductor`, reached through a weak reference.

    NOTE: torch.compile keeps every backend it is given in a process-wide table (torch._dynamo.eval_frame's
    cached_backends, emptied only by torch._dynamo.reset()). A bound method there would hold the DecodeGraphs, its
    model and its KV cache for the life of the process: measured, each dropped engine of a tiny model kept its 2 GiB
    of KV cache. The table keeps this object alone."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self._graphs = weakref.ref(graphs)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
                 ) -> Callable[..., list[torch.Tensor]]:
        graphs = self._graphs()
        assert graphs is not None, "a dropped engine's decode step compiled"
        return graphs._inductor(graph, example_inputs)


def _capture(step: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    """A CUDA (HIP on ROCm) graph of step, which reads and writes only static tensors; replaying it returns
    the graph's own output tensor."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture (allocator, autotuning)
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay
