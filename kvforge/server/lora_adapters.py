"""LoRA adapters by the name a request's `model` field gives: those of `--lora-modules name=path` at start, and those
loaded and unloaded at run time (`POST /v1/load_lora_adapter {lora_name, lora_path}`, `POST
/v1/unload_lora_adapter {lora_name}`, behind the API key like every /v1 route).

Unloading forgets the name: the adapter's new requests get 404, while its requests already running finish with it
(they carry their adapter), as do every other adapter's. A name loaded again gets a new id, so its prefix cache
and device slot start afresh.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse

from kvforge.lora.request import LoRARequest
from kvforge.server.errors import APIError

if TYPE_CHECKING:
    from kvforge.engine.llm_engine import LLMEngine

router = APIRouter()


def parse_lora_modules(values: list[str] | None, base_names: tuple[str, ...]) -> dict[str, str]:
    """`--lora-modules name=path ...` as {name: path}; ValueError naming a value without both, or a name given twice
    (or the base model's)."""
    pairs: dict[str, str] = {}
    for value in values or []:
        name, _, path = value.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {value!r}")
        if name in pairs or name in base_names:
            raise ValueError(f"--lora-modules: the model name {name!r} is given twice")
        pairs[name] = path
    return pairs


class LoRAAdapters:
    """The served adapters by name; each gets an id of its own (1, 2, ...) when loaded."""

    def __init__(self, base_names: tuple[str, ...]) -> None:
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new(self, name: str, path: str) -> LoRARequest:
        """The request of an adapter not served yet (400 for a name taken by the base model or another adapter)."""
        if name in self.base_names or name in self.by_name:
            raise APIError(400, f"the model name {name!r} is already served", param="lora_name")
        return LoRARequest(name, next(self._ids), path)

    def load_at_start(self, engine: LLMEngine, modules: dict[str, str]) -> None:
        """Serve `--lora-modules` (read and checked now: ValueError naming a bad adapter)."""
        for name, path in modules.items():
            lora = self.new(name, path)
            engine.add_lora(lora)
            self.by_name[name] = lora

    def unload(self, name: str) -> None:
        if self.by_name.pop(name, None) is None:
            raise APIError(404, f"no LoRA adapter {name!r} is loaded; loaded: {sorted(self.by_name)}",
                           param="lora_name", code="model_not_found")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, http_request: Request) -> JSONResponse:
    state = http_request.app.state.server
    if not state.engine.engine.config.lora.enable_lora:
        raise APIError(400, "this server does not serve LoRA adapters; start it with --enable-lora",
                       param="lora_name")
    adapters: LoRAAdapters = state.adapters
    lora = adapters.new(body.lora_name, body.lora_path)
    try:
        await state.engine.add_lora(lora)  # read and checked on the engine's thread
    except ValueError as error:
        raise APIError(400, str(error), param="lora_path") from error
    adapters.by_name.setdefault(lora.name, lora)
    return JSONResponse({"status": "ok", "lora_name": lora.name})


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, http_request: Request) -> JSONResponse:
    http_request.app.state.server.adapters.unload(body.lora_name)
    return JSONResponse({"status": "ok", "lora_name": body.lora_name})
