"""From a model name (folder, GGUF file or None for the default) to a loaded model and tokenizer."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvforge.config import ModelConfig
from kvforge.kernels.cpu.bf16_gemm import bf16_matmuls_supported, use_bf16_matmuls
from kvforge.kernels.cpu.dense_gemv import use_dense_gemv
from kvforge.layers.pooler import PoolerConfig
from kvforge.loader.heap import release_freed_memory
from kvforge.loader.hub_cache import resolve_model_path
from kvforge.loader.huge_pages import huge_pages_offered, move_to_huge_pages
from kvforge.loader.memory_fit import check_fits
from kvforge.loader.pooling_config import read_pooler_config
from kvforge.loader.safetensors_dir import (
    iterate_safetensors,
    read_hf_config,
    safetensors_files,
    safetensors_weight_bytes,
)
from kvforge.models.registry import resolve_model_class
from kvforge.quantization import (
    checkpoint_tensors,
    format_entry,
    process_weights_after_loading,
    quantize_model,
    quantize_vocab_rows,
    resolve_quant_config,
)
from kvforge.quantization.gguf_quants import keep_16bit, keep_gguf_quantized
from kvforge.quantization.weight_only_kernels import PanelArena, pack_into
from kvforge.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    hf_config: dict
    dtype: torch.dtype
    name: str
    pooler: PoolerConfig | None = None  # how a pooling model pools (runner "pooling")


def resolve_dtype(requested: str, hf_config: dict, device: torch.device) -> torch.dtype:
    """'auto' is float32 on the CPU and the checkpoint's half type (else bfloat16) on a GPU."""
    if requested != "auto":
        return _TORCH_DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return torch.float16 if stored == "float16" else torch.bfloat16


def _releasing_freed_memory(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, the memory freed by converting the previous ones handed back before each."""
    for item in weights:
        release_freed_memory()
        yield item


def _with_classifier_token_ids(hf_config: dict, tokenizer: Tokenizer) -> dict:
    """A reranker's `classifier_from_token` (e.g. ["no", "yes"]) as token ids, for its classifier head."""
    tokens = hf_config.get("classifier_from_token")
    if tokens is None:
        return hf_config
    return {**hf_config, "classifier_from_token_ids": [tokenizer.token_id(token) for token in tokens]}


def _takes_bf16_matmuls(config: ModelConfig, model: nn.Module, device: torch.device, runner: str) -> bool:
    """The option asks for bfloat16 products, the model is one whose outputs hold within their bound with them (an
    embedding encoder: `takes_bf16_matmuls`) run for pooling on the CPU, and the CPU has the kernel's instructions
    (AMX). Its float32 layers then take them (a model run in 16 bits has none)."""
    return (config.bf16_matmuls and runner == "pooling" and getattr(model, "takes_bf16_matmuls", False)
            and device.type == "cpu" and bf16_matmuls_supported())


def load_model(config: ModelConfig, device: torch.device, kv_cache_bytes: int = 0,
               runner: str = "generate") -> LoadedModel:
    """Build the architecture named by the checkpoint, for the runner ("generate" or "pooling"), and fill it with its
    weights. On the CPU, a model whose weights and kv_cache_bytes do not fit in the memory left is refused first
    (loader/memory_fit.py)."""
    if config.model is None:
        from kvforge.loader.default_model import default_model_path

        path = Path(default_model_path())
    else:
        path = resolve_model_path(config.model)
    keep_gguf = path.is_file() and config.keeps_gguf_blocks  # keep a GGUF file's quantized tensors as they are
    if path.is_file():
        from kvforge.loader.gguf import load_gguf

        checkpoint = load_gguf(str(path), torch.float32, keep_quantized=keep_gguf)
        hf_config, tokenizer = checkpoint.config, checkpoint.tokenizer
        model_class = resolve_model_class(hf_config, runner)
        weights = iter(checkpoint.tensors.items())
    else:
        if config.keeps_gguf_blocks_only:
            raise ValueError(f"quantization='gguf' keeps a .gguf file's quantized tensors; {str(path)!r} is a folder")
        hf_config = read_hf_config(path)
        model_class = resolve_model_class(hf_config, runner)  # an unknown architecture fails before anything else
        tokenizer = Tokenizer.from_dir(str(path))
        hf_config = _with_classifier_token_ids(hf_config, tokenizer)
        weights = None
    pooler = read_pooler_config(path, model_class.is_causal) if runner == "pooling" else None
    quant_config = resolve_quant_config(hf_config, config.online_quantization)
    from_float = "quantization_config" not in hf_config  # a float checkpoint, quantized (if at all) at load time
    dtype = resolve_dtype(config.dtype, hf_config, device)
    huge_pages = config.huge_pages and device.type == "cpu" and huge_pages_offered()
    arena = None
    if device.type == "cpu":
        weight_bytes = (checkpoint.weight_bytes(dtype) if path.is_file()
                        else safetensors_weight_bytes(safetensors_files(path), dtype))
        check_fits(path.name, weight_bytes, kv_cache_bytes)
        arena = PanelArena.for_model(weight_bytes, huge_pages)
    with torch.device(device):
        model = model_class(hf_config, dtype)  # parameters in the run dtype; rope tables stay float32
        if arena is not None:
            pack_into(model, arena)
        if quant_config is not None:
            quantize_model(model, quant_config, from_float)
        if keep_gguf:
            keep_16bit(model, checkpoint.half_dtypes, vocab=config.quantize_lm_head)
            weights = keep_gguf_quantized(model, checkpoint.tensors, checkpoint.quantized,
                                          checkpoint.quantized_layouts, vocab=config.quantize_lm_head)
    if weights is None:
        weights = iterate_safetensors(safetensors_files(path), dtype)
        if quant_config is not None:
            weights = checkpoint_tensors(quant_config, from_float, weights)
    model.load_weights(_releasing_freed_memory(weights))
    process_weights_after_loading(model)
    if config.quantize_lm_head and quant_config is not None and format_entry(quant_config).quantizes_vocab:
        quantize_vocab_rows(model)
    use_dense_gemv(model)
    if _takes_bf16_matmuls(config, model, device, runner):
        num_layers = use_bf16_matmuls(model)
        logger.info("bfloat16 products (AMX) in %d float32 layers (--no-bf16-matmuls: float32)", num_layers)
    if huge_pages:
        move_to_huge_pages(model)
    model.eval()
    logger.info("loaded %s (%s) as %s on %s", path.name, model_class.__name__, dtype, device)
    return LoadedModel(model, tokenizer, hf_config, dtype, str(path), pooler)
