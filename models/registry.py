"""Which port serves which HF `architectures` entry (and, for configs without one, which `model_type`)."""

from __future__ import annotations

from jaxpaged.models.bloom import BloomForCausalLM
from jaxpaged.models.deepseek import DeepseekForCausalLM
from jaxpaged.models.falcon import FalconForCausalLM
from jaxpaged.models.gemma import GemmaForCausalLM
from jaxpaged.models.gemma4 import Gemma4ForCausalLM
from jaxpaged.models.glm4_moe import Glm4MoeForCausalLM
from jaxpaged.models.granite import GraniteForCausalLM
from jaxpaged.models.gpt2 import GPT2LMHeadModel, GPTBigCodeForCausalLM
from jaxpaged.models.gpt_oss import GptOssForCausalLM
from jaxpaged.models.gpt_neox import GPTNeoXForCausalLM
from jaxpaged.models.gptj import GPTJForCausalLM
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.llama4 import Llama4ForCausalLM
from jaxpaged.models.minimax_m2 import MiniMaxM2ForCausalLM
from jaxpaged.models.mistral3 import Ministral3ForCausalLM
from jaxpaged.models.mixtral import MoeForCausalLM
from jaxpaged.models.mpt import MptForCausalLM
from jaxpaged.models.nemotron_h import NemotronHForCausalLM
from jaxpaged.models.olmo2 import Olmo2ForCausalLM
from jaxpaged.models.olmoe import OlmoeForCausalLM
from jaxpaged.models.opt import OPTForCausalLM
from jaxpaged.models.phi import Phi3ForCausalLM, PhiForCausalLM
from jaxpaged.models.pooling_head import POOLING_ARCHITECTURES, port_architecture
from jaxpaged.models.vision.gemma3 import Gemma3ForConditionalGeneration
from jaxpaged.models.vision.gemma4 import Gemma4ForConditionalGeneration
from jaxpaged.models.vision.llama4 import Llama4ForConditionalGeneration
from jaxpaged.models.vision.llava import LlavaForConditionalGeneration
from jaxpaged.models.vision.mistral3 import Mistral3ForConditionalGeneration
from jaxpaged.models.vision.qwen3_5 import Qwen3_5ForConditionalGeneration
from jaxpaged.models.vision.qwen_vl import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration
from jaxpaged.models.smollm3 import SmolLM3ForCausalLM
from jaxpaged.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama + sliding window
    "Qwen2ForCausalLM": LlamaForCausalLM,  # Llama + q/k/v bias
    "Qwen3ForCausalLM": LlamaForCausalLM,  # Llama + q/k norm
    "SeedOssForCausalLM": LlamaForCausalLM,  # Llama + q/k/v biases, o_proj's own attention_out_bias
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,  # Llama + NoPE layers (no_rope_layers)
    "GraniteForCausalLM": GraniteForCausalLM,  # Llama + embedding, attention, residual and logits multipliers
    "Ministral3ForCausalLM": Ministral3ForCausalLM,  # Llama + YaRN and Llama 4's q temperature (llama_4_scaling_beta)
    "Mistral3ForConditionalGeneration": Mistral3ForConditionalGeneration,  # + the Pixtral tower, patch merger, projector
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "GPTJForCausalLM": GPTJForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "BloomForCausalLM": BloomForCausalLM,
    "MptForCausalLM": MptForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,  # Phi-1/1.5/2
    "Phi3ForCausalLM": Phi3ForCausalLM,  # Phi-3, Phi-3.5, Phi-4-mini
    "MixtralForCausalLM": MoeForCausalLM,  # Llama attention + sparse MoE MLP (models/moe.py)
    "Qwen2MoeForCausalLM": MoeForCausalLM,  # + shared expert, dense layers where configured
    "Qwen3MoeForCausalLM": MoeForCausalLM,  # + q/k norm
    "Olmo2ForCausalLM": Olmo2ForCausalLM,  # post-norm layers, q/k norm over the whole projection
    "Olmo3ForCausalLM": Olmo2ForCausalLM,  # + sliding and full layers, RoPE per layer type
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,  # attention sinks, sliding/full layers, biased MoE with clamped SwiGLU
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,  # multi-head latent attention (a latent cache), MoE with shared experts
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,  # + q low-rank, sigmoid router with groups and a correction bias
    "DeepseekV32ForCausalLM": DeepseekForCausalLM,  # V3's dense MLA, its sparse indexer not run: up to index_topk
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,  # GLM-4.5/4.6/4.7: partial RoPE, DeepSeek-V3's router and shared experts
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,  # whole-projection q/k norm, partial RoPE, sigmoid router with bias
    "Llama4ForCausalLM": Llama4ForCausalLM,  # chunked local attention on RoPE layers, NoPE layers, top-1 sigmoid MoE + shared
    "Llama4ForConditionalGeneration": Llama4ForConditionalGeneration,  # + its vision model and projector (models/vision/)
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,  # + sandwich norms, soft-caps, sliding windows
    "Gemma3ForCausalLM": GemmaForCausalLM,  # + q/k norm, RoPE per layer type
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # + SigLIP and the projector (models/vision/)
    "Gemma4ForCausalLM": Gemma4ForCausalLM,  # per-layer embeddings, shared K/V, global layers' own head dim, MoE
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,  # + its vision tower (models/vision/); audio skipped
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,  # Qwen2 with M-RoPE + its window ViT
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,  # Qwen3, interleaved M-RoPE, DeepStack
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,  # LLaVA-1.5: CLIP + a GELU projector; Pixtral-12B
    "LlavaNextForConditionalGeneration": LlavaForConditionalGeneration,  # + any-resolution tiles, unpad, newlines
    "LlavaOnevisionForConditionalGeneration": LlavaForConditionalGeneration,  # SigLIP, tiles resized to anyres_max_N
    # hybrids: linear layers keep a state per sequence beside the paged KV (models/hybrid.py)
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,  # Gated DeltaNet + gated attention, MoE with a shared expert
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,  # the same layers, dense MLP, q/k/v and z apart
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,  # + MoE with a shared expert
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,  # the hybrid text model under Qwen3-VL's tower
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "NemotronHForCausalLM": NemotronHForCausalLM,  # Mamba-2, attention and MLP blocks
}

# Families vLLM serves whose transformers code lives on the hub (trust_remote_code); jaxpaged never runs it.
REMOTE_CODE_ARCHITECTURES = {
    "BaichuanForCausalLM": "Baichuan",
    "InternLMForCausalLM": "InternLM",
    "AquilaForCausalLM": "Aquila",
    "AquilaModel": "Aquila",
    "QWenLMHeadModel": "Qwen (1)",
}


def supported_architectures() -> list[str]:
    """The ports' architectures and the pooling ones they serve (models/pooling_head.py)."""
    return sorted({*MODEL_REGISTRY, *POOLING_ARCHITECTURES})


def resolve_architecture(architectures: list[str] | None, model_type: str | None = None) -> tuple[str, type]:
    """The first listed architecture we support, else a ValueError naming them and ours. A pooling architecture
    (`Qwen3Model`, `LlamaForSequenceClassification`) resolves to its CausalLM, whose port runs it."""
    names = list(architectures or [])
    if not names and model_type:
        names = [MODEL_TYPE_TO_ARCHITECTURE.get(model_type, model_type)]
    for name in map(port_architecture, names):
        if name in MODEL_REGISTRY:
            return name, MODEL_REGISTRY[name]
    remote = [REMOTE_CODE_ARCHITECTURES[n] for n in names if n in REMOTE_CODE_ARCHITECTURES]
    hint = (
        f" ({remote[0]} needs trust_remote_code in transformers, i.e. running code from the checkpoint; "
        "jaxpaged has no port of it)" if remote else ""
    )
    raise ValueError(
        f"unsupported model architecture {', '.join(names) or '(none given)'}{hint}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "mistral3": "Mistral3ForConditionalGeneration",
    "gpt2": "GPT2LMHeadModel",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "gptj": "GPTJForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "opt": "OPTForCausalLM",
    "falcon": "FalconForCausalLM",
    "bloom": "BloomForCausalLM",
    "mpt": "MptForCausalLM",
    "phi": "PhiForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "llama4_text": "Llama4ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "nemotron_h": "NemotronHForCausalLM",
}
