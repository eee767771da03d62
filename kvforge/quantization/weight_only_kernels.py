"""The kernels a weight-only layer (W8A16, W4A16, GGUF kept) multiplies with, as objects chosen once at load.

Each kernel is a small module holding the weight in the layout it streams best, a LinearKernel
(layers/linear_kernel.py):

    prepare(weight, arena)   QuantizedWeight -> its own buffers (the codes as stored, repacked for the kernel; a
                             layout interleaved by part goes into the loader's PanelArena)
    apply(x)           x [M, K] float -> x W^T + b [M, N] in x's dtype (x's columns in the weight's order first,
                       for GPTQ act-order); `multiply` is each kernel's own product
    gather_rows(ids)   rows W[ids] [len(ids), K] float32 (an embedding lookup that dequantizes only those rows)

    panels     the C++ AVX-512 VNNI kernel (kernels/cpu/quant_panels.py): 4-, 6- and 8-bit codes, any zero points,
               x rounded to int8 per 32 columns at every batch size, 16 weight rows interleaved per panel
    native     the C++ AVX2 kernels (kernels/cpu/quant_gemv.py): 4- and 8-bit codes, any zero points; the
               decode GEMV rounds x to int8 per 32 columns, as llama.cpp does
    int8pack   torch's _weight_int8pack_mm: symmetric per-row 8-bit codes
    int4pack   torch's _weight_int4pack_mm_for_cpu: 4-bit, rows a multiple of 16, groups 32 to 256
    generic    the op table's quant_gemm (Triton on GPUs, dequantize + matmul on the CPU)

Each kernel says which weights it takes (`fits`); `select_kernel` takes the first in WEIGHT_ONLY_KERNELS, the
order of preference (kernels/cpu/packed_gemm.py has the CPU measurements behind it), that fits the weight and the
device. A new format adds a kernel class and its place in that tuple; the layers and the loader stay as they are.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from kvforge.kernels.cpu import packed_gemm
from kvforge.kernels.cpu.quant_gemv import pack_weight, quant_linear_cpu
from kvforge.kernels.cpu.quant_panels import pack_panels, panel_linear, panel_rows
from kvforge.kernels.ops import OpTable
from kvforge.kernels.quant_gemm import dequantize_ref, pack_codes
from kvforge.layers.linear_kernel import KernelModule, WeightArena
from kvforge.loader.huge_pages import HUGE_PAGE, arena_offsets, huge_page_arena
from kvforge.platforms.zeroed_memory import zeroed_memory
from kvforge.quantization.quantized_weight import QuantizedWeight, RowShards


class WeightOnlyKernel(KernelModule):
    """Base: a quantized weight [N, K] in one kernel's layout."""

    code_bits = (4, 8)  # the widths of codes its layout stores (5- and 6-bit codes go to the others as 8-bit ones)
    takes_row_shards = False  # prepare takes a merged layer's RowShards as they are (the others get them stacked)

    @classmethod
    def fits(cls, weight: QuantizedWeight, device: torch.device, ops: OpTable, needs_rows: bool) -> bool:
        """This kernel takes weight on device (needs_rows: it must also gather rows, as a tied embedding)."""
        raise NotImplementedError

    @classmethod
    def build(cls, ops: OpTable, dtype: torch.dtype) -> WeightOnlyKernel:
        """An empty kernel, to prepare (dtype: the layer's float type)."""
        return cls()

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("perm", None, persistent=False)  # [K] int64: x's columns in the weight's order

    def prepare(self, weight: QuantizedWeight, arena: WeightArena | None = None) -> None:
        """Repack weight into this kernel's buffers (arena: where a layout interleaved by part is placed)."""
        raise NotImplementedError

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x[:, self.perm]
        return self.biased(self.multiply(x))

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (columns in the weight's order) times the weight: [M, N] in x's dtype."""
        raise NotImplementedError

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _on_cpu(device: torch.device, ops: OpTable) -> bool:
    """The CPU kernels run here: a CPU device whose op table is torch's (not Triton's, as the interpreter's tests)."""
    return device.type == "cpu" and ops.backend == "torch"


class PanelKernel(WeightOnlyKernel):
    name = "panels"
    code_bits = (4, 5, 6, 8)
    takes_row_shards = True

    @classmethod
    def fits(cls, weight: QuantizedWeight, device: torch.device, ops: OpTable, needs_rows: bool) -> bool:
        return _on_cpu(device, ops) and packed_gemm.panels_eligible(weight)

    def prepare(self, weight: QuantizedWeight | RowShards, arena: WeightArena | None = None) -> None:
        shards = weight.shards if isinstance(weight, RowShards) else [weight]
        self.bits, self.out_features = weight.bits, sum(shard.codes.shape[0] for shard in shards)
        self.in_features = shards[0].codes.shape[1]
        packed, self.factor = pack_panels(*([getattr(shard, name) for shard in shards]
                                            for name in ("codes", "scales", "zeros")),
                                          weight.bits, place=None if arena is None else arena.place)
        self.register_buffer("weight", packed, persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return panel_linear(x, self.weight, self.factor, self.bits, self.out_features)

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return panel_rows(self.weight, self.factor, self.bits, ids, self.in_features)


class PanelArena:
    """Where panel-layout weights are packed (pack_panels' place): one region of memory per part, region t holding
    part t of each weight one after another in the order they were placed, each at a multiple of 64 bytes:

        arena  [w0 part 0 | w1 part 0 | ... | wn part 0 | ... || w0 part 1 | w1 part 1 | ... | wn part T-1]

    Thread t multiplies part t of each weight, so in the order they are placed (the order the model calls them) it
    reads one run of memory, and the hardware prefetchers run on from one weight into the next. The regions are
    reserved, not written: the arena is one mapping of zero pages (in 2 MiB pages where asked, loader/huge_pages.py),
    backed as the weights are written into it, so no packed weight is ever copied and its untouched end takes no
    memory. A weight in another number of parts, or one that no longer fits, gets memory of its own."""

    def __init__(self, parts: int, region_bytes: int, huge_pages: bool) -> None:
        self.parts = parts
        self.region = -(-region_bytes // HUGE_PAGE) * HUGE_PAGE  # regions begin at 2 MiB boundaries
        size = parts * self.region
        self._memory = huge_page_arena(size) if huge_pages else zeroed_memory(size)
        self._used = 0  # bytes placed in each region

    @classmethod
    def for_model(cls, weight_bytes: int, huge_pages: bool) -> PanelArena:
        """An arena for a model whose weights take about weight_bytes (as memory_fit counts them), in as many parts as
        torch has threads. NOTE: a K-quant whose scales make no super-blocks keeps a half scale and offset per group,
        more bytes than the file's (Q4_K: 5 bits a weight against 4.5; Q5_K: 6 against 5.5), and an MoE layer's gate
        and up experts share the wider one's codes: each region reserves a fourth more, and 64 MiB for the panels'
        padding rows."""
        parts = torch.get_num_threads()
        return cls(parts, weight_bytes * 5 // 4 // parts + (64 << 20), huge_pages)

    def place(self, parts: int, part_bytes: int) -> torch.Tensor:
        """An unwritten uint8 [parts, part_bytes], part t in region t at the next multiple of 64 bytes."""
        if parts != self.parts or self._used + part_bytes > self.region:
            return torch.empty(parts, part_bytes, dtype=torch.uint8)
        view = self._memory.as_strided((parts, part_bytes), (self.region, 1),
                                       self._memory.storage_offset() + self._used)
        self._used = arena_offsets([self._used + part_bytes])[1]
        return view


def pack_into(model: nn.Module, arena: PanelArena) -> None:
    """Before loading: every layer that keeps a packed weight (Linear, the vocabulary) packs it into arena, in the
    order its weights are converted (a GGUF file's: the order the model runs them, loader/gguf.py; a safetensors
    folder's: its names' order, where each thread reads the same bytes, only not in one run)."""
    for module in model.modules():
        if hasattr(module, "weight_arena"):
            module.weight_arena = arena


def interleaved_views(weights: list[torch.Tensor], huge_pages: bool) -> list[torch.Tensor]:
    """Unwritten tensors of the shapes of panel-layout weights (the same number of parts T) in one PanelArena, in
    the given order, for copies of them."""
    parts = {weight.shape[0] for weight in weights}
    if len(parts) != 1:
        raise ValueError(f"the weights are in different numbers of parts: {sorted(parts)}")
    sizes = [weight[0].nbytes for weight in weights]
    arena = PanelArena(len(weights[0]), arena_offsets(sizes)[1], huge_pages)
    return [arena.place(len(weight), size).as_strided(weight.shape, (arena.region, *weight.stride()[1:]))
            for weight, size in zip(weights, sizes)]


class NativeKernel(WeightOnlyKernel):
    name = "native"

    @classmethod
    def fits(cls, weight: QuantizedWeight, device: torch.device, ops: OpTable, needs_rows: bool) -> bool:
        return _on_cpu(device, ops) and packed_gemm.native_eligible(weight)

    def prepare(self, weight: QuantizedWeight, arena: WeightArena | None = None) -> None:
        self.bits = weight.bits
        codes, scales, offsets = pack_weight(weight.codes, weight.scales, weight.zeros, weight.bits)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: int8 activations in the GEMV (up to GEMV_MAX_TOKENS rows): 1.4-2.4x faster per call than fp32 x
        # (warm, one thread), and the default model's mean perplexity over the shipped texts moves by 0.2%
        # (15.233 -> 15.263 with every row through the GEMV); greedy answers can flip at near-ties.
        return quant_linear_cpu(x, self.codes, self.scales, self.offsets, self.bits, int8_activations=True)

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvforge_cpu.quant_dequantize(self.codes[ids], self.scales[ids], self.offsets[ids], self.bits)


class Int8PackKernel(WeightOnlyKernel):
    name = "int8pack"

    @classmethod
    def fits(cls, weight: QuantizedWeight, device: torch.device, ops: OpTable, needs_rows: bool) -> bool:
        return _on_cpu(device, ops) and packed_gemm.int8pack_eligible(weight)

    def prepare(self, weight: QuantizedWeight, arena: WeightArena | None = None) -> None:
        codes, scales = packed_gemm.prepack_int8(weight)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return packed_gemm.int8pack_linear(x, self.codes, self.scales)

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codes[ids].float() * self.scales[ids, None]


class Int4PackKernel(WeightOnlyKernel):
    """NOTE: torch's int4 layout has no row gather: layers that are also embeddings never get this kernel."""

    name = "int4pack"

    @classmethod
    def fits(cls, weight: QuantizedWeight, device: torch.device, ops: OpTable, needs_rows: bool) -> bool:
        return _on_cpu(device, ops) and not needs_rows and packed_gemm.int4pack_eligible(weight)

    def prepare(self, weight: QuantizedWeight, arena: WeightArena | None = None) -> None:
        self.group_size = weight.group_size
        packed, scales_zeros = packed_gemm.prepack_int4(weight)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return packed_gemm.int4pack_linear(x, self.packed, self.scales_zeros, self.group_size)


class GenericKernel(WeightOnlyKernel):
    name = "generic"

    def __init__(self, ops: OpTable, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.dtype = ops, dtype

    @classmethod
    def fits(cls, weight: QuantizedWeight, device: torch.device, ops: OpTable, needs_rows: bool) -> bool:
        return True

    @classmethod
    def build(cls, ops: OpTable, dtype: torch.dtype) -> WeightOnlyKernel:
        return cls(ops, dtype)

    def prepare(self, weight: QuantizedWeight, arena: WeightArena | None = None) -> None:
        self.bits = weight.bits
        self.register_buffer("codes", pack_codes(weight.codes, weight.bits), persistent=False)
        self.register_buffer("scales", weight.scales.to(self.dtype).contiguous(), persistent=False)
        # NOTE: zero points that are not integers (GGUF Q4_1's -m / d) stay float32, which a half type
        # would round by up to a whole code when they are a few hundred codes from the block.
        zeros_dtype = self.dtype if torch.equal(weight.zeros, weight.zeros.round()) else torch.float32
        self.register_buffer("zeros", weight.zeros.to(zeros_dtype).contiguous(), persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.quant_gemm(x, self.codes, self.scales, self.zeros, self.bits)

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_ref(self.codes[ids], self.scales[ids].float(), self.zeros[ids].float(), self.bits)


# In order of preference: the first that fits a weight runs it (the generic kernel takes any).
WEIGHT_ONLY_KERNELS: tuple[type[WeightOnlyKernel], ...] = (
    PanelKernel, NativeKernel, Int8PackKernel, Int4PackKernel, GenericKernel,
)


def select_kernel(weight: QuantizedWeight | RowShards, device: torch.device, dtype: torch.dtype, ops: OpTable,
                  needs_rows: bool = False, arena: WeightArena | None = None,
                  bias: nn.Parameter | None = None) -> WeightOnlyKernel:
    """The first of WEIGHT_ONLY_KERNELS that takes weight on device, prepared (into arena where its layout goes
    there) and moved there, adding bias (a layer's). needs_rows: the weight is also looked up by row (a tied
    embedding). A merged layer's RowShards go as they are to a kernel that takes them, else stacked into one
    weight."""
    if isinstance(weight, RowShards):
        leading = itertools.takewhile(lambda k: k.takes_row_shards, WEIGHT_ONLY_KERNELS)  # before one that stacks
        outline = weight.outline()
        kernel_class = next((k for k in leading if weight.bits in k.code_bits and k.fits(outline, device, ops,
                                                                                             needs_rows)), None)
        if kernel_class is not None:
            return _prepared(kernel_class, weight, device, dtype, ops, arena, bias)
        weight = weight.stacked()

    def stored(kernel_class: type[WeightOnlyKernel]) -> QuantizedWeight:  # the weight as its layout stores it
        return weight if weight.bits in kernel_class.code_bits else weight.widened()

    kernel_class = next(k for k in WEIGHT_ONLY_KERNELS if k.fits(stored(k), device, ops, needs_rows))
    return _prepared(kernel_class, stored(kernel_class), device, dtype, ops, arena, bias)


def _prepared(kernel_class: type[WeightOnlyKernel], weight: QuantizedWeight | RowShards, device: torch.device,
              dtype: torch.dtype, ops: OpTable, arena: WeightArena | None,
              bias: nn.Parameter | None) -> WeightOnlyKernel:
    kernel = kernel_class.build(ops, dtype)
    kernel.prepare(weight, arena)
    shards = weight.shards if isinstance(weight, RowShards) else [weight]
    kernel.bind(sum(shard.codes.shape[0] for shard in shards), shards[0].codes.shape[1], bias)
    kernel.perm = None if isinstance(weight, RowShards) else weight.perm  # a merged layer's shards: input order
    return kernel.to(device)
