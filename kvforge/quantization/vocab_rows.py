"""The vocabulary (the embedding, and the LM head: one module when tied) kept quantized: a GGUF file's blocks as they
are, or int8 codes per row with a zero point at load time. The head then runs through the weight-only GEMV, and a
lookup dequantizes only the rows it gathers (layers/embedding.py's `keep_kernel`)."""

from __future__ import annotations

from torch import nn

from kvforge.kernels.ops import current_ops
from kvforge.layers.embedding import VocabParallelEmbedding
from kvforge.quantization.quantized_weight import QuantizedWeight, quantize_rtn
from kvforge.quantization.weight_only_kernels import select_kernel


def keep_rows_quantized(module: VocabParallelEmbedding, local: QuantizedWeight) -> None:
    """Replace the module's float weight with this rank's rows [V_local, hidden], quantized, in the fastest kernel
    that also gathers rows."""
    weight = module.weight
    module.keep_kernel(select_kernel(local, weight.device, weight.dtype, current_ops(), needs_rows=True,
                                     arena=module.weight_arena))


def load_quantized_rows(module: VocabParallelEmbedding, weight: QuantizedWeight) -> None:
    """Keep this rank's rows of the full [vocab_size, hidden] quantized tensor as they are (the float weight is
    dropped): padding rows get code 0, scale 0 and zero point 0."""
    if tuple(weight.codes.shape) != (module.vocab_size, module.hidden_size) or weight.perm is not None:
        raise ValueError(f"quantized embedding of shape {tuple(weight.codes.shape)}, expected "
                         f"{(module.vocab_size, module.hidden_size)} in input order")
    rows = module.local_rows
    keep_rows_quantized(module, QuantizedWeight(rows(weight.codes), rows(weight.scales), rows(weight.zeros),
                                                weight.bits))


def quantize_vocab_rows(model: nn.Module) -> None:
    """The embedding and the LM head (one module when tied) as int8 codes per row with a zero point: the head
    then runs through the weight-only GEMV, and lookups dequantize only their rows."""
    modules = {id(m): m for m in (getattr(model, "embed_tokens", None), getattr(model, "lm_head", None))}
    for module in modules.values():
        if module is not None and module.kernel is None:
            keep_rows_quantized(module, quantize_rtn(module.weight.data, 8, -1, sym=False))
