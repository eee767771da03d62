"""The adapter a request runs with: a name, an id unique per adapter, and its PEFT folder."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT LoRA adapter (a folder of adapter_config.json and adapter_model.safetensors).

    int_id (>= 1) identifies the adapter everywhere below the API: its device slot, its host copy and its prefix
    cache (block hashes include it). Two requests with the same int_id must name the same folder."""

    name: str
    int_id: int
    path: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a LoRA adapter needs a name")
        if not isinstance(self.int_id, int) or self.int_id < 1:
            raise ValueError(f"LoRA adapter {self.name!r}: int_id must be an integer >= 1, got {self.int_id!r}")
