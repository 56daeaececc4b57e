"""Which port serves which HF `architectures` entry."""

from __future__ import annotations

from models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_architecture(architectures: list[str] | None, model_type: str | None = None) -> tuple[str, type]:
    """The first listed architecture we support, else a ValueError naming them and ours."""
    names = list(architectures or [])
    if not names and model_type:
        names = [MODEL_TYPE_TO_ARCHITECTURE.get(model_type, model_type)]
    for name in names:
        if name in MODEL_REGISTRY:
            return name, MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model architecture {', '.join(names) or '(none given)'}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


MODEL_TYPE_TO_ARCHITECTURE = {"llama": "LlamaForCausalLM"}
