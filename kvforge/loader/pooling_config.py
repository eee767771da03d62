"""Which runner a checkpoint wants, and how a pooling checkpoint pools: the sentence-transformers folder layout.

    modules.json                 [{"type": "sentence_transformers.models.Transformer", "path": ""},
                                  {"type": "...models.Pooling", "path": "1_Pooling"},
                                  {"type": "...models.Normalize", "path": "2_Normalize"}]
    1_Pooling/config.json        pooling_mode_cls_token / pooling_mode_mean_tokens / pooling_mode_lasttoken
    sentence_bert_config.json    max_seq_length: the longest input the model was trained on
"""

from __future__ import annotations

import json
from pathlib import Path

from kvforge.config import ModelConfig
from kvforge.layers.pooler import PoolerConfig
from kvforge.loader.hub_cache import resolve_model_path
from kvforge.loader.safetensors_dir import read_hf_config
from kvforge.models.registry import is_pooling_architecture

_MODULES = "modules.json"
_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


def resolve_runner(config: ModelConfig) -> str:
    """"generate" or "pooling": as configured, or (auto) pooling for a sentence-transformers folder or an
    encoder / classifier architecture."""
    if config.runner != "auto":
        return config.runner
    if config.model is None:
        return "generate"  # the default model
    path = resolve_model_path(config.model)
    if path.is_file():  # a GGUF file
        return "generate"
    if (path / _MODULES).is_file():
        return "pooling"
    return "pooling" if is_pooling_architecture(read_hf_config(path)) else "generate"


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def read_pooler_config(path: Path, is_causal: bool) -> PoolerConfig:
    """The checkpoint folder's pooling: its sentence-transformers modules where it has them; else the last
    token's hidden state for a decoder, the first (CLS) token's for an encoder, normalised."""
    if path.is_file() or not (path / _MODULES).is_file():
        return PoolerConfig("last" if is_causal else "cls", normalize=True)
    modules = _read_json(path / _MODULES)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    unknown = sorted(set(kinds) - set(_KNOWN_MODULES))
    if unknown:
        raise ValueError(f"{path / _MODULES} has sentence-transformers modules {unknown} that are not supported "
                         f"(supported: {list(_KNOWN_MODULES)})")
    pooling_type = "last" if is_causal else "cls"
    if "Pooling" in kinds:
        pooling = _read_json(path / kinds["Pooling"] / "config.json")
        if any(pooling.get(mode) for mode in _UNSUPPORTED_MODES):
            raise ValueError(f"{path / kinds['Pooling']}: pooling modes {_UNSUPPORTED_MODES} are not supported")
        modes = [kind for mode, kind in _POOLING_MODES.items() if pooling.get(mode)]
        if len(modes) != 1:
            raise ValueError(f"{path / kinds['Pooling']} must turn on exactly one of {list(_POOLING_MODES)}")
        pooling_type = modes[0]
    settings = path / "sentence_bert_config.json"
    max_seq_length = _read_json(settings).get("max_seq_length") if settings.is_file() else None
    return PoolerConfig(pooling_type, normalize="Normalize" in kinds, max_seq_length=max_seq_length)
