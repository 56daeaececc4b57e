"""LoRARequest, as vLLM's: which adapter a request runs with."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, eq=False)
class LoRARequest:
    """An adapter by name, a positive integer id (unique per adapter in an engine) and its PEFT folder (or hub id).

    vLLM's positional order (its fourth field is base_model_name too). Equal and hashed by lora_name alone, as
    vLLM's: the same adapter named again with another id or path is the same key in a set or dict.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string (got {self.lora_name!r})")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer (got {self.lora_int_id!r})")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's folder (got {self.lora_path!r})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_salt(self) -> bytes:
        """What salts the prefix cache's first block hash: the adapter's id and where its weights came from."""
        return f"lora:{self.lora_int_id}:{self.lora_path}".encode()
