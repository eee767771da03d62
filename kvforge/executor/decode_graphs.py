"""Decode steps compiled once per batch bucket and replayed: torch.compile (Inductor), plus a CUDA/HIP graph
of each bucket on GPUs.

A decode-only step of n sequences runs the graph of the smallest bucket b >= n once it is ready. A bucket that has
run `compile_after` steps eagerly is compiled on a thread of its own (background_compile.py) while its steps go on
eagerly, and its graph is swapped in at the start of a later step, on the engine's thread: no step ever waits for a
compile. Each bucket's inputs live in static buffers of its own, updated in place each step (so a compile, which
runs its bucket once on padding rows, writes nothing that a running step reads); rows n..b-1 are padding that
writes no cache slot and attends to nothing:

    row              0 .. n-1 (the step's sequences)        n .. b-1 (padding)
    input_ids        the new tokens                           0
    positions        their positions                          0
    slot_mapping     where their keys and values go           -1     (the cache write skips it)
    seq_lens         context lengths                          0      (attention outputs zeros)
    block_tables     [n, max_blocks] rows of the step         stale rows, never read (seq_len 0)
    state_slot_ids   each sequence's recurrent-state slot      the padding slot (no request's)
    has_initial_state  true (a decode continues its state)     false

A model of several layer groups in its KV cache (sliding-window and full attention) has a slot mapping and block
tables per group, padded as above; a hybrid model's linear-attention layers read and write their states in the slots
of state_slot_ids, where padding rows use a slot of their own that no request holds (RecurrentStates.padding_slot).

Each bucket's graph (model forward + LM head: fp32 logits [b, vocab]) is compiled with static shapes; norms,
rotary, SiLU-and-mul and residual adds fuse, while the cache write, attention and quantized matmuls stay opaque ops.
Since its inputs (the static buffers, the caches and the parameters) are the same tensors every step, a replay calls
Inductor's graph on them directly: dynamo runs only to compile. On GPUs the engine's thread captures the graph
(CUDA/HIP graph) when it swaps it in, between steps. On the CPU, the graphs of small batches call their kernels
from Inductor's C++ wrapper, the others from its Python one. Inductor's on-disk caches make a second start of the
same model compile nothing new (`kvforge compile` fills them ahead).
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.executor.background_compile import CompileThread
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
    C++ wrapper, their C entry points (kernels/cpu/bindings.py: c_shim), which it then calls instead of the
    dispatcher."""
    options: dict[str, object] = dict(size_asserts=False, alignment_asserts=False, cpp_wrapper=cpp_wrapper)
    if device.type == "cpu" and cpu_kernels() is not None:
        options["post_grad_custom_post_pass"] = _kernels_build(cpu_kernels().__name__)
        if cpp_wrapper:
            options["aot_inductor.custom_ops_to_c_shims"] = c_shims()
    return options


@dataclass(slots=True)
class _StaticInputs:
    """One bucket's input buffers, which its graph reads every step: [bucket] rows (block_tables [bucket,
    max_blocks_per_seq]), padding rows as allocated; other_groups: groups 1..'s (slot_mapping, block_tables);
    state_slot_ids and has_initial_state: a hybrid model's (None without linear-attention layers)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    other_groups: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    state_slot_ids: torch.Tensor | None
    has_initial_state: torch.Tensor | None
    padding_state_slot: int | None

    @classmethod
    def allocate(cls, bucket: int, max_blocks_per_seq: int, device: torch.device, num_groups: int = 1,
                 padding_state_slot: int | None = None) -> _StaticInputs:
        def slots_and_tables() -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.full((bucket,), -1, dtype=torch.int64, device=device),
                    torch.zeros(bucket, max_blocks_per_seq, dtype=torch.int32, device=device))

        slot_mapping, block_tables = slots_and_tables()
        states = padding_state_slot is not None
        return cls(
            input_ids=torch.zeros(bucket, dtype=torch.int64, device=device),
            positions=torch.zeros(bucket, dtype=torch.int64, device=device),
            slot_mapping=slot_mapping,
            seq_lens=torch.zeros(bucket, dtype=torch.int32, device=device),
            block_tables=block_tables,
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=device),
            other_groups=tuple(slots_and_tables() for _ in range(num_groups - 1)),
            state_slot_ids=torch.full((bucket,), padding_state_slot, dtype=torch.int32, device=device) if states
            else None,
            has_initial_state=torch.zeros(bucket, dtype=torch.bool, device=device) if states else None,
            padding_state_slot=padding_state_slot)

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping, query_start_loc=self.query_start_loc,
                                 seq_lens=self.seq_lens, block_tables=self.block_tables, decode_only=True,
                                 other_groups=self.other_groups, state_slot_ids=self.state_slot_ids,
                                 has_initial_state=self.has_initial_state)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """The step's n rows, then padding (a previous step's rows may linger there)."""
        num_seqs = input_ids.shape[0]
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self.input_ids[num_seqs:].zero_()
        self.positions[num_seqs:].zero_()
        self.seq_lens[num_seqs:].zero_()
        groups = ((self.slot_mapping, self.block_tables), *self.other_groups)
        step_groups = ((metadata.slot_mapping, metadata.block_tables), *metadata.other_groups)
        for (slot_mapping, block_tables), (step_slots, step_tables) in zip(groups, step_groups, strict=True):
            slot_mapping[:num_seqs].copy_(step_slots)
            slot_mapping[num_seqs:].fill_(-1)
            block_tables[:num_seqs, : step_tables.shape[1]].copy_(step_tables)
        if self.state_slot_ids is not None:
            self.state_slot_ids[:num_seqs].copy_(metadata.state_slot_ids)
            self.state_slot_ids[num_seqs:].fill_(self.padding_state_slot)
            self.has_initial_state[:num_seqs].copy_(metadata.has_initial_state)
            self.has_initial_state[num_seqs:].zero_()


class DecodeGraphs:
    """The compiled decode step of one model runner: `run` takes a decode-only step of at most
    `max_batch` sequences and returns its logits [num_seqs, vocab] once its bucket is compiled. `stepping()` wraps
    every step of the runner (the compiles yield to it); `close()` stops the compiles.

    num_groups: the paged layer groups of the KV cache (a slot mapping and block tables each); padding_state_slot: a
    hybrid model's state slot for padding rows (None without linear-attention layers); compiler: the compile thread of
    another DecodeGraphs to share (a draft model's steps run inside its runner's, which lend the turns), None for a
    thread of its own."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, ...]], buckets: tuple[int, ...],
                 compile_after: int, max_blocks_per_seq: int, device: torch.device, num_groups: int = 1,
                 padding_state_slot: int | None = None, compiler: CompileThread | None = None) -> None:
        self.model = model
        self.compile_after = compile_after
        self._eager_steps = dict.fromkeys(buckets, 0)  # bucket -> decode steps it ran eagerly
        self.kv_caches = kv_caches
        self.buckets = buckets
        self.max_batch = buckets[-1]
        self.device = device
        self._inputs = {b: _StaticInputs.allocate(b, max_blocks_per_seq, device, num_groups, padding_state_slot)
                        for b in buckets}
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}  # bucket -> its ready graph
        self._submitted: set[int] = set()  # buckets given to the compile thread, not swapped in yet
        self._owns_compiler = compiler is None
        self.compiler = CompileThread("kvforge-compile") if compiler is None else compiler
        self.wrappers: dict[int, str] = {}  # bucket -> the wrapper Inductor built for its graph: "C++" or "Python"
        self.failed = False  # a bucket could not be compiled: every step runs eagerly from then on

    @property
    def compiled_buckets(self) -> tuple[int, ...]:
        """The buckets whose graphs are swapped in."""
        return tuple(sorted(self._replays))

    @property
    def num_compiling(self) -> int:
        """Buckets queued or compiling in the background (any thread may ask)."""
        return self.compiler.num_pending

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding num_seqs sequences; None above the largest (or after a failed compile)."""
        return None if self.failed else next((b for b in self.buckets if b >= num_seqs), None)

    def stepping(self) -> AbstractContextManager[None]:
        """Wraps each step of the runner: a compile pauses while a step runs (see background_compile.py)."""
        return self.compiler.step()

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
            ) -> torch.Tensor | None:
        """input_ids, positions [n]; metadata of a decode-only step of n <= max_batch sequences -> logits
        [n, vocab]; None (nothing ran) while the bucket is not compiled yet, or when the model cannot be
        compiled: the caller runs the step eagerly."""
        self._swap_in()
        bucket = self.bucket_for(input_ids.shape[0])
        if bucket is None:  # a compile failed just now
            return None
        assert metadata.decode_only
        replay = self._replays.get(bucket)
        if replay is None:
            if self._eager_steps[bucket] < self.compile_after:
                self._eager_steps[bucket] += 1
            elif bucket not in self._submitted:
                self._submit(bucket)
            return None
        self._inputs[bucket].fill(input_ids, positions, metadata)
        return replay()[: input_ids.shape[0]]

    def compile_ahead(self, max_seqs: int, wait: bool = True) -> None:
        """Compile every bucket of at most max_seqs sequences that is not compiled yet: now, on this thread (a
        benchmark's warm-up, `kvforge compile`), or in the background from now on (not wait). Each runs once on
        padding rows, which write no cache slot and attend to nothing."""
        missing = [b for b in self.buckets if b <= max_seqs and b not in self._replays and b not in self._submitted]
        if not wait:
            for bucket in missing:
                self._submit(bucket)
            return
        self.compiler.wait()
        self._swap_in()
        for bucket in missing:
            if self.failed or bucket in self._replays:
                continue
            try:
                built: Callable[[], torch.Tensor] | BaseException = self._build(bucket)
            except torch._dynamo.exc.TorchDynamoException as err:
                built = err
            self._install(bucket, built)

    def close(self) -> None:
        """Cancel the queued and running compiles (the engine is shutting down; a shared thread: its owner's)."""
        if self._owns_compiler:
            self.compiler.close()

    def _submit(self, bucket: int) -> None:
        self._submitted.add(bucket)
        self.compiler.submit((self, bucket), lambda: self._build(bucket))

    def _swap_in(self) -> None:
        """On the engine's thread, between steps: take the graphs compiled since the last step."""
        for bucket, built in self.compiler.results(self):
            self._submitted.discard(bucket)
            self._install(bucket, built)

    def _install(self, bucket: int, built: object) -> None:
        """The bucket's graph replays from now on (captured on GPUs); or, where it cannot be compiled, every step
        runs eagerly."""
        if isinstance(built, torch._dynamo.exc.TorchDynamoException):  # raised while tracing: nothing has run
            logger.warning("cannot compile the decode step of %s (%s); running it eagerly",
                           type(self.model).__name__, str(built).splitlines()[0])
            self.failed = True
        elif isinstance(built, BaseException):
            raise built
        else:
            self._replays[bucket] = _capture(built, self.device) if self.device.type == "cuda" else built

    def _build(self, bucket: int) -> Callable[[], torch.Tensor]:
        """On the compile thread: compile the bucket's step; returns what replays it on the bucket's buffers."""
        start = time.perf_counter()
        _trace_fx_once(self.compiler)
        inputs = self._inputs[bucket]
        backend = _WeakBackend(self, bucket)
        # NOTE: torch.compile keeps its graphs on the code object of the function it compiles: a copy of _step's code
        # per bucket of each instance keeps buckets and engines apart (and a bucket never counts as a recompile).
        step = types.FunctionType(DecodeGraphs._step.__code__.replace(), globals(), "_step")
        try:
            with torch.inference_mode():  # as the runner's steps run: a graph compiled outside it would not match them
                torch.compile(step, fullgraph=True, dynamic=False, backend=backend)(
                    self, inputs.input_ids, inputs.positions, inputs.metadata())
        finally:
            built = backend.take()
        assert built is not None, "dynamo ran the bucket's step without compiling it"
        graph, graph_inputs = built

        def replay() -> torch.Tensor:
            # NOTE: every step passes the same static buffers, caches and parameters, which are the graph's
            # inputs: the compiled graph is called on them directly, without dynamo's frame (guards and
            # gathering ~490 tensors from the model: ~2.5 ms a step of the default model, 2-core EPYC).
            return graph(*graph_inputs)[0]

        logger.info("compiled the decode step for batch %d in %.1f s (%s wrapper)", bucket,
                    time.perf_counter() - start, self.wrappers[bucket])
        return replay

    def _inductor(self, batch: int, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
                  ) -> Callable[..., list[torch.Tensor]]:
        """The torch.compile backend: Inductor (inductor_options). Small CPU batches get the C++ wrapper
        (CPP_WRAPPER_MAX_BATCH), or Python's where it cannot be built."""
        from torch._inductor.compile_fx import compile_fx

        # dynamo raises what a backend raises as BackendCompilerFailed: the engine then runs eagerly
        if not all(isinstance(t, torch.Tensor) for t in example_inputs):
            raise TypeError("a decode step's graph takes tensors only (static shapes)")
        if len(graph.graph.output_node().args[0]) != 1:
            raise TypeError("a decode step's graph returns its logits only")
        wrappers = ("C++", "Python") if self.device.type == "cpu" and batch <= CPP_WRAPPER_MAX_BATCH else ("Python",)
        for wrapper in wrappers:
            try:
                with torch._inductor.config.patch({**inductor_options(self.device, wrapper == "C++"),
                                                   **self.compiler.thread_options()}):
                    compiled = compile_fx(graph, example_inputs)
                break
            except Exception as err:  # noqa: BLE001 -- the Python wrapper compiles whatever Inductor compiles
                if wrapper == wrappers[-1]:
                    raise
                logger.warning("cannot build the C++ wrapper of the decode step for batch %d (%s); using Python's",
                               batch, str(err).splitlines()[0] if str(err) else type(err).__name__)
        self.wrappers[batch] = wrapper
        return compiled


class _WeakBackend:
    """The torch.compile backend of one bucket of a DecodeGraphs: its `_inductor`, reached through a weak reference;
    `take()` hands over what it compiled (the compiled graph and the tensors it takes) and forgets it.

    NOTE: torch.compile keeps every backend it is given in a process-wide table (torch._dynamo.eval_frame's
    cached_backends, emptied only by torch._dynamo.reset()). A bound method or a closure there would hold the
    DecodeGraphs, its model and its KV cache for the life of the process: measured, each dropped engine of a tiny model
    kept its 2 GiB of KV cache. The table keeps this small object alone."""

    def __init__(self, graphs: DecodeGraphs, bucket: int) -> None:
        self._graphs = weakref.ref(graphs)
        self._bucket = bucket
        self._built: tuple[Callable[..., list[torch.Tensor]], list[torch.Tensor]] | None = None

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
                 ) -> Callable[..., list[torch.Tensor]]:
        graphs = self._graphs()
        assert graphs is not None, "a dropped engine's decode step compiled"
        compiled = graphs._inductor(self._bucket, graph, example_inputs)
        self._built = compiled, list(example_inputs)
        return compiled

    def take(self) -> tuple[Callable[..., list[torch.Tensor]], list[torch.Tensor]] | None:
        built, self._built = self._built, None
        return built


def _trace_fx_once(compiler: CompileThread) -> None:
    """The one torch.fx symbolic trace Inductor runs in a process (LoopBody's placeholder module, cached), alone.

    NOTE: while torch.fx's Tracer traces, torch.nn.Module.__call__ is its wrapper in every thread, and an eager step
    calling the model then raised "module is not installed as a submodule". Inductor's other traces (make_fx) wrap
    module calls with a pass-through."""
    from torch._inductor.loop_body import InterpreterShim  # imported in the compile's turns: seconds of Python

    with compiler.alone():
        InterpreterShim._dummy_gm()


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
    # NOTE: thread-local capture: a compile of another bucket may use the device from its thread meanwhile
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        output = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay
