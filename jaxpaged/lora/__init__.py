"""LoRA adapters served over one base model: the request type, and the engine's adapters on the host and device."""

from jaxpaged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
