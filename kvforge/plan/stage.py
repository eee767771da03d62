"""One pipeline stage as one of its tensor-parallel ranks holds it: weights, buffers, KV cache per token,
activations, and the parameters and attention FLOPs a token costs there.

How a TP x PP split cuts the model (as the engine's parallel layers do):

    pipeline   stage s runs layers [s * L // pp, (s + 1) * L // pp); the embedding lives on the first
               stage, the final norm and LM head on the last (a tied head is a second copy unless pp = 1)
    tensor     q/o projections, MLPs, shared and routed experts, embedding and LM head rows: 1 / tp each;
               k/v projections and KV cache: 1 / tp of the KV heads, or 1 head per rank once ranks
               outnumber the KV heads (replicated); MLA's latent cache and down-projections, norms,
               routers and rotary tables: whole on every rank

A hybrid model's linear-attention layers keep a state per running request instead (split over the ranks like their
heads), as many slots as the engine runs requests at once, plus its padding slot and the prefix cache's checkpoints.

A sliding-window layer keeps a sequence's last blocks only (the KV cache manager's sliding window groups): its KV
bytes per token are counted over a sequence of the plan's context length, ceil((W - 1) / block_size) + 1 blocks of
it at most.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.config import CacheConfig
from kvforge.plan.model_shape import LayerShape, ModelShape
from kvforge.plan.precision import Precision


@dataclass(frozen=True, slots=True)
class Stage:
    """Bytes and costs on one rank of a pipeline stage."""

    index: int
    first_layer: int
    end_layer: int
    weight_bytes: float  # every parameter this rank holds
    expert_bytes: float  # the routed experts among them (a decode step reads those its tokens chose)
    lookup_bytes: float  # the embedding table when it is only looked up (a row per token is read)
    buffer_bytes: float  # rotary tables
    packed_bytes: float  # float32 on the CPU: the copy of each layer matrix and the LM head packed for oneDNN
    activation_bytes: float  # the largest step's intermediates (max_num_batched_tokens, max_num_seqs)
    kv_bytes_per_token: float  # this rank's KV cache per token
    state_bytes_per_seq: float  # this rank's linear-attention states per running request (hybrid models)
    active_params: float  # parameters each token multiplies with on this rank, LM head aside
    lm_head_params: float  # this rank's LM head rows (multiplied for sampled tokens only)
    decode_attn_flops: float  # per query token and context token, this rank's heads and layers
    prefill_attn_flops: float  # per (query, key) pair, this rank's heads and layers
    is_first: bool
    is_last: bool

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    @property
    def fixed_bytes(self) -> float:
        """Memory that does not depend on the KV cache size."""
        return self.weight_bytes + self.buffer_bytes + self.packed_bytes + self.activation_bytes


def kv_head_fraction(shape: ModelShape, tp: int) -> float:
    """Share of the KV heads one rank holds: 1 / tp, or one head once ranks outnumber the heads."""
    if shape.num_kv_heads == 0:
        return 1.0
    return 1 / tp if shape.num_kv_heads >= tp else 1 / shape.num_kv_heads


def layer_range(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """[start, end) of the layers of pipeline stage `stage`: as even a split as possible."""
    return stage * num_layers // pp, (stage + 1) * num_layers // pp


def build_stages(
    shape: ModelShape, tp: int, pp: int, precision: Precision, max_num_batched_tokens: int, max_num_seqs: int,
    packs: bool = False, context_len: int = 4096,
) -> list[Stage]:
    """Every pipeline stage of a TP x PP split, as its tensor-parallel rank 0 sees it. packs: the float layers and
    head also hold a copy packed for oneDNN (a CPU engine's float32 weights, kernels/cpu/dense_gemv.py);
    context_len: the sequence length over which sliding-window layers' KV bytes per token are counted."""
    return [_stage(shape, tp, pp, s, precision, max_num_batched_tokens, max_num_seqs, packs, context_len)
            for s in range(pp)]


def kept_fraction(layer: LayerShape, context_len: int) -> float:
    """The share of a context_len-token sequence's tokens whose keys and values the layer keeps."""
    if layer.sliding_window is None:
        return 1.0
    block_size = CacheConfig().block_size
    kept = (-(-(layer.sliding_window - 1) // block_size) + 1) * block_size
    return min(1.0, kept / context_len)


def _stage(
    shape: ModelShape, tp: int, pp: int, index: int, p: Precision, num_tokens: int, num_seqs: int, packs: bool,
    context_len: int,
) -> Stage:
    start, end = layer_range(shape.num_layers, pp, index)
    layers = shape.layers[start:end]
    kv_fraction = kv_head_fraction(shape, tp)
    is_first, is_last = index == 0, index == pp - 1
    vocab_rows = -(-shape.vocab_size // tp) * shape.hidden_size  # the vocabulary is padded to tp rows
    embedding = vocab_rows * p.activation_bytes if is_first else 0.0
    lm_head = vocab_rows * p.activation_bytes if is_last and not (shape.tied_embeddings and pp == 1) else 0.0
    final_norm = shape.final_norm * p.activation_bytes if is_last else 0.0
    head_is_embedding = shape.tied_embeddings and pp == 1
    layer_bytes = sum(_layer_bytes(layer, tp, kv_fraction, p) for layer in layers)
    matrices = sum(layer.sharded / tp + layer.kv * kv_fraction + layer.replicated for layer in layers)
    packed = (matrices + (vocab_rows if is_last else 0)) * p.weight_bytes if packs else 0.0
    return Stage(
        index=index, first_layer=start, end_layer=end,
        weight_bytes=layer_bytes + embedding + lm_head + final_norm,
        expert_bytes=sum(layer.experts for layer in layers) / tp * p.weight_bytes,
        lookup_bytes=0.0 if head_is_embedding else embedding,
        buffer_bytes=float(sum(layer.buffer_bytes for layer in layers) + shape.global_buffer_bytes),
        packed_bytes=packed,
        activation_bytes=_activation_bytes(shape, tp, is_last, p, num_tokens, num_seqs),
        kv_bytes_per_token=sum(_layer_kv_bytes(layer, kv_fraction, p) * kept_fraction(layer, context_len)
                               for layer in layers),
        state_bytes_per_seq=sum(layer.state_values * p.activation_bytes + layer.state_fp32_values * 4
                                for layer in layers) / tp,
        active_params=sum(_layer_active_params(shape, layer, tp, kv_fraction) for layer in layers),
        lm_head_params=vocab_rows if is_last else 0.0,
        decode_attn_flops=len(layers) * shape.decode_attn_flops / tp,
        prefill_attn_flops=len(layers) * shape.prefill_attn_flops / tp,
        is_first=is_first, is_last=is_last,
    )  # fmt: skip


def _layer_bytes(layer: LayerShape, tp: int, kv_fraction: float, p: Precision) -> float:
    matrices = layer.sharded / tp + layer.kv * kv_fraction + layer.replicated + layer.experts / tp
    return matrices * p.weight_bytes + layer.floats * p.activation_bytes + layer.fp32 * 4


def _layer_active_params(shape: ModelShape, layer: LayerShape, tp: int, kv_fraction: float) -> float:
    routed = layer.experts / tp * shape.top_k / shape.num_experts if shape.num_experts else 0.0
    return layer.sharded / tp + layer.kv * kv_fraction + layer.replicated + routed + layer.fp32


def _layer_kv_bytes(layer: LayerShape, kv_fraction: float, p: Precision) -> float:
    heads = layer.kv_heads_values * p.kv_value_bytes + layer.kv_head_rows * p.kv_scale_bytes
    return heads * kv_fraction + layer.kv_latent_values * p.kv_value_bytes


def _activation_bytes(shape: ModelShape, tp: int, is_last: bool, p: Precision, num_tokens: int, num_seqs: int
                      ) -> float:  # fmt: skip
    """The largest step's live intermediates: the residual stream (3 copies of the hidden state), then
    the larger of attention's (q, k, v, output) and the MLP's (gate|up, product; an MoE's top_k copies),
    plus, on the last stage, float32 logits and probabilities over the whole vocabulary per sampled row.

    NOTE: attention itself is counted as flash-style (no [query, key] score matrix), and allocator
    slack, CUDA graphs and communication buffers are left to the memory the engine keeps in reserve."""
    hidden = 3 * num_tokens * shape.hidden_size
    attention = num_tokens * shape.attn_act_width / tp
    mlp = num_tokens * (shape.mlp_act_width / tp + shape.moe_act_width)
    logits = 2 * min(num_seqs, num_tokens) * shape.vocab_size * 4 if is_last else 0
    return (hidden + max(attention, mlp)) * p.activation_bytes + logits
