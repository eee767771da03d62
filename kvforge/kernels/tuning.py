"""Launch parameters of every Triton kernel, per GPU architecture, in one table.

Block sizes are powers of two that tile a 64-wide AMD wavefront as well as a 32-wide NVIDIA warp.
Architectures not in the table get DEFAULT_TUNING (also what the CPU interpreter uses).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvforge.platforms import Platform, current_platform


def _check_power_of_2(owner: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1 or value & (value - 1):
            raise ValueError(f"{owner}.{name} must be a power of two, got {value}")


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """FlashAttention-2 style prefill: block_m query rows (tokens x heads of one KV group) per program,
    block_n keys per step of the inner loop."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _check_power_of_2("PrefillTiles", block_m=self.block_m, block_n=self.block_n, num_warps=self.num_warps)
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"PrefillTiles blocks must be >= 16 (tl.dot), got {self.block_m}x{self.block_n}")


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    """Flash-decoding: the key range of each (sequence, KV head) is split across programs until the grid
    holds about programs_per_unit programs per SM/CU, at most max_splits splits."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_unit: int
    max_splits: int
    reduce_num_warps: int = 4  # the kernel that merges the splits of one (sequence, head)
    latent_block_n: int = 0  # keys per step of MLA decode, whose rows are 576 wide; 0: block_n

    def __post_init__(self) -> None:
        _check_power_of_2(
            "DecodeTiles",
            block_n=self.block_n,
            num_warps=self.num_warps,
            max_splits=self.max_splits,
            reduce_num_warps=self.reduce_num_warps,
            latent_block_n=self.latent_block_n or 16,
        )
        if self.block_n < 16 or self.programs_per_unit < 1 or 0 < self.latent_block_n < 16:
            raise ValueError(
                f"DecodeTiles needs block_n >= 16, latent_block_n 0 or >= 16, programs_per_unit >= 1: {self}"
            )

    @property
    def mla_block_n(self) -> int:
        return self.latent_block_n or self.block_n

    def num_splits(self, num_seqs: int, num_kv_heads: int, num_compute_units: int) -> int:
        """How many key-range splits keep every SM/CU busy for num_seqs x num_kv_heads decodes.

        NOTE: a power of two: the split count is a compile-time constant of the kernel, so serving
        every batch size compiles at most log2(max_splits) + 1 variants."""
        programs = max(num_seqs * num_kv_heads, 1)
        wanted = min(self.max_splits, -(-self.programs_per_unit * num_compute_units // programs))
        return 1 << (max(wanted, 1).bit_length() - 1)


@dataclass(frozen=True, slots=True)
class RowTiles:
    """One-program-per-token kernels (norm, rotary, cache write, activation): one warp per
    elements_per_warp elements of the row, at most max_warps."""

    elements_per_warp: int
    max_warps: int
    activation_block: int  # silu_and_mul output columns per program

    def __post_init__(self) -> None:
        _check_power_of_2(
            "RowTiles",
            elements_per_warp=self.elements_per_warp,
            max_warps=self.max_warps,
            activation_block=self.activation_block,
        )

    def num_warps(self, block: int) -> int:
        return max(1, min(self.max_warps, block // self.elements_per_warp))


@dataclass(frozen=True, slots=True)
class ArchTuning:
    """Everything one architecture needs. prefill_wide serves padded head sizes above 128."""

    prefill: PrefillTiles
    prefill_wide: PrefillTiles
    decode: DecodeTiles
    rows: RowTiles

    def prefill_tiles(self, padded_head_dim: int) -> PrefillTiles:
        return self.prefill if padded_head_dim <= 128 else self.prefill_wide


_WARP32_ROWS = RowTiles(elements_per_warp=256, max_warps=16, activation_block=1024)
_WAVE64_ROWS = RowTiles(elements_per_warp=512, max_warps=16, activation_block=1024)  # 64-wide wavefronts

DEFAULT_TUNING = ArchTuning(
    prefill=PrefillTiles(block_m=64, block_n=32, num_warps=4, num_stages=2),
    prefill_wide=PrefillTiles(block_m=32, block_n=32, num_warps=4, num_stages=1),
    decode=DecodeTiles(block_n=32, num_warps=4, num_stages=2, programs_per_unit=2, max_splits=16),
    rows=_WARP32_ROWS,
)

_HOPPER_TUNING = ArchTuning(
    prefill=PrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=3),
    prefill_wide=PrefillTiles(block_m=64, block_n=64, num_warps=8, num_stages=2),
    decode=DecodeTiles(block_n=64, num_warps=4, num_stages=3, programs_per_unit=2, max_splits=32),
    rows=_WARP32_ROWS,
)

ARCH_TUNING: dict[str, ArchTuning] = {
    # A100: 164 KiB shared memory per SM.
    # NOTE: at block_n=64 (hd128) or 4 warps (hd256) the prefill kernel spills registers on sm_80
    # (`kvforge compile-kernels --arch sm_80`); these tiles do not.
    "sm_80": ArchTuning(
        prefill=PrefillTiles(block_m=128, block_n=32, num_warps=8, num_stages=2),
        prefill_wide=PrefillTiles(block_m=64, block_n=32, num_warps=8, num_stages=2),
        decode=DecodeTiles(block_n=64, num_warps=4, num_stages=2, programs_per_unit=2, max_splits=32),
        rows=_WARP32_ROWS,
    ),
    # H100 / H200 (and B200, sm_100): 228 KiB shared memory per SM, deeper pipelines pay off.
    "sm_90": _HOPPER_TUNING,
    "sm_100": _HOPPER_TUNING,
    # MI200 (CDNA2): 64 KiB LDS per CU, no async-copy pipelining: one stage.
    "gfx90a": ArchTuning(
        prefill=PrefillTiles(block_m=128, block_n=32, num_warps=4, num_stages=1),
        prefill_wide=PrefillTiles(block_m=64, block_n=32, num_warps=4, num_stages=1),
        decode=DecodeTiles(block_n=64, num_warps=4, num_stages=1, programs_per_unit=2, max_splits=32),
        rows=_WAVE64_ROWS,
    ),
    # MI300X (CDNA3): 304 CUs, the stream pipeliner double-buffers with num_stages=2. 64 latent rows of
    # MLA (64 x 576 x 2 bytes, double-buffered) would need 72 KiB of LDS.
    "gfx942": ArchTuning(
        prefill=PrefillTiles(block_m=128, block_n=64, num_warps=4, num_stages=2),
        prefill_wide=PrefillTiles(block_m=64, block_n=32, num_warps=4, num_stages=1),
        decode=DecodeTiles(
            block_n=64, num_warps=4, num_stages=2, programs_per_unit=2, max_splits=32, latent_block_n=32
        ),  # fmt: skip
        rows=_WAVE64_ROWS,
    ),
    # Radeon RX 7900 (RDNA3): 32-wide waves hold a tile over half the lanes of a CDNA wavefront, so
    # tiles are halved or warps doubled, and one stage; wider tiles spill registers. NOTE: MLA decode
    # still spills here (a 16-head x 512 latent accumulator); DeepSeek is not a single-Radeon model.
    "gfx1100": ArchTuning(
        prefill=PrefillTiles(block_m=64, block_n=16, num_warps=8, num_stages=1),
        prefill_wide=PrefillTiles(block_m=32, block_n=16, num_warps=8, num_stages=1),
        decode=DecodeTiles(block_n=16, num_warps=4, num_stages=1, programs_per_unit=2, max_splits=16),
        rows=_WARP32_ROWS,
    ),
}


@functools.cache
def tuning_for_arch(arch: str) -> ArchTuning:
    """The table entry of an architecture ("sm_90", "gfx942", ...), DEFAULT_TUNING when it has none."""
    return ARCH_TUNING.get(arch, DEFAULT_TUNING)


def kernel_tuning(platform: Platform | None = None) -> ArchTuning:
    """The launch parameters for platform (default: the current one)."""
    return tuning_for_arch((platform if platform is not None else current_platform()).arch)


@dataclass(frozen=True, slots=True)
class GemmTiles:
    """Quantized GEMM tiles: block_m tokens x block_n output features per program, block_k per step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _check_power_of_2(
            "GemmTiles", block_m=self.block_m, block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps
        )
        if min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError(f"GemmTiles blocks must be >= 16 (tl.dot), got {self}")


# (decode: M <= 16, prefill) per architecture. NOTE: decode tiles keep block_m at the tl.dot minimum
# and spend the registers on block_n, so that a 1-token batch still spreads over every SM/CU.
_GEMM_TILES: dict[str, tuple[GemmTiles, GemmTiles]] = {
    "default": (GemmTiles(16, 64, 64, 4, 2), GemmTiles(64, 64, 32, 4, 2)),
    "sm_80": (GemmTiles(16, 64, 128, 4, 3), GemmTiles(64, 128, 32, 4, 3)),
    "sm_90": (_hopper_gemm := (GemmTiles(16, 128, 128, 4, 4), GemmTiles(128, 128, 64, 8, 3))),
    "sm_100": _hopper_gemm,
    "gfx90a": (GemmTiles(16, 64, 128, 4, 1), GemmTiles(64, 64, 64, 4, 1)),
    "gfx942": (GemmTiles(16, 64, 128, 4, 2), GemmTiles(64, 128, 64, 8, 2)),
}


def gemm_tiles(num_tokens: int, platform: Platform | None = None) -> GemmTiles:
    """Tiles of the quantized GEMMs for a batch of num_tokens rows on platform (default: current)."""
    arch = (platform if platform is not None else current_platform()).arch
    decode, prefill = _GEMM_TILES.get(arch, _GEMM_TILES["default"])
    return decode if num_tokens <= 16 else prefill


# Rows of a step from which batched LoRA segments its rows by adapter (SGMV: each program multiplies BLOCK_M rows of
# one adapter with tl.dot) instead of one program per row (BGMV: each row reads its adapter's whole matrix).
# NOTE: a first guess, not measured yet (scripts/bench_lora_kernels.py on a quiet GPU sets it): BGMV
# rereads an adapter once per row, SGMV pays for moe_align and a block's padding rows.
_LORA_SEGMENTED_MIN_ROWS: dict[str, int] = {"default": 64}


def lora_segmented(num_rows: int, platform: Platform | None = None) -> bool:
    """Whether a batched LoRA product of num_rows rows runs segmented by adapter (SGMV) on platform."""
    arch = (platform if platform is not None else current_platform()).arch
    return num_rows >= _LORA_SEGMENTED_MIN_ROWS.get(arch, _LORA_SEGMENTED_MIN_ROWS["default"])
