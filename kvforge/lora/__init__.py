"""LoRA adapters served over one base model: the request that names one (request.py), the PEFT folder reader
(adapter.py), the per-layer slot weights and their batched apply (layer.py), and the pool of device slots with its
host-side registry (pool.py)."""

from kvforge.lora.request import LoRARequest

__all__ = ["LoRARequest"]
