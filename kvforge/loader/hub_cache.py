"""A Hugging Face hub id ("org/name") as the folder (or .gguf file) of its copy in the local cache.

Nothing is downloaded: the cache is read as `huggingface_hub` writes it,
`<cache>/models--org--name/snapshots/<revision>/`, with `refs/main` naming the revision.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def resolve_model_path(model: str) -> Path:
    """model as a path when it exists; else, for a hub id, its snapshot in the cache (a lone .gguf file in a
    snapshot without config.json is the model). A ValueError names the path or the cache looked in."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not _HUB_ID.match(model):
        raise ValueError(f"model {model!r} not found: give a checkpoint folder, a .gguf file or a hub id (org/name)")
    cache = hub_cache_dir()
    repo = cache / ("models--" + model.replace("/", "--"))
    snapshot = _snapshot(repo)
    if snapshot is None:
        raise ValueError(f"model {model!r} is not a local path and is not in the Hugging Face cache {cache} "
                         f"(no snapshot under {repo}); download it first, e.g. `hf download {model}`, or set "
                         f"HF_HOME to the cache that holds it")
    ggufs = sorted(snapshot.glob("*.gguf"))
    if not (snapshot / "config.json").exists() and len(ggufs) == 1:
        return ggufs[0]
    return snapshot


def _snapshot(repo: Path) -> Path | None:
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) if repo.is_dir() else []
    return snapshots[-1] if snapshots else None
