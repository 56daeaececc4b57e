"""Pooling checkpoints (embedding and sequence-classification models) loaded into the CausalLM ports, as vLLM's
adapters (as_embedding_model, as_seq_cls_model) load them.

- `*Model` architectures (AutoModel.save_pretrained: `LlamaModel`, `Qwen3Model`; e5-mistral-7b-instruct's
  `MistralModel`) store the decoder without its `model.` prefix (models/weights.py checkpoint_name adds it back) and
  no lm_head. Some embedding models say `*ForCausalLM` with that same layout (Qwen3-Embedding).
- `*ForSequenceClassification` (transformers' GenericForSequenceClassification) stores `model.*` and a bias-free
  `score.weight` [num_labels, hidden], which the host applies: read here as float32, never a Flax parameter.
  `*ForTokenClassification` (GenericForTokenClassification: a token classifier, a process reward model) stores the
  same with a `score.bias` [num_labels] (unless its config's token_classification_bias is false), applied per token.
- sentence-transformers' `modules.json` says how to pool (its Pooling module's config.json) and whether to normalize
  (a Normalize module), read as vLLM's get_pooling_config reads them (json only).

A pooling checkpoint that stores no lm_head gets the head tied to its embeddings: its logits are never used.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from jaxpaged.models.config import ModelConfig, text_config
from jaxpaged.models.weights import checkpoint_name

logger = logging.getLogger("jaxpaged.loader")

# pooling architecture -> (the CausalLM architecture whose port runs it, its task)
POOLING_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaModel": ("LlamaForCausalLM", "embed"),
    "MistralModel": ("MistralForCausalLM", "embed"),
    "Qwen2Model": ("Qwen2ForCausalLM", "embed"),
    "Qwen3Model": ("Qwen3ForCausalLM", "embed"),
    "GemmaModel": ("GemmaForCausalLM", "embed"),
    "Gemma2Model": ("Gemma2ForCausalLM", "embed"),
    "Gemma3TextModel": ("Gemma3ForCausalLM", "embed"),
    "LlamaForSequenceClassification": ("LlamaForCausalLM", "classify"),
    "MistralForSequenceClassification": ("MistralForCausalLM", "classify"),
    "Qwen2ForSequenceClassification": ("Qwen2ForCausalLM", "classify"),
    "Qwen3ForSequenceClassification": ("Qwen3ForCausalLM", "classify"),
    "GemmaForSequenceClassification": ("GemmaForCausalLM", "classify"),
    "Gemma2ForSequenceClassification": ("Gemma2ForCausalLM", "classify"),
    "Gemma3TextForSequenceClassification": ("Gemma3ForCausalLM", "classify"),
    "LlamaForTokenClassification": ("LlamaForCausalLM", "token_classify"),
    "MistralForTokenClassification": ("MistralForCausalLM", "token_classify"),
    "Qwen2ForTokenClassification": ("Qwen2ForCausalLM", "token_classify"),
    "Qwen3ForTokenClassification": ("Qwen3ForCausalLM", "token_classify"),
    "GemmaForTokenClassification": ("GemmaForCausalLM", "token_classify"),
    "Gemma2ForTokenClassification": ("Gemma2ForCausalLM", "token_classify"),
}
CLASSIFIER = "score.weight"
CLASSIFIER_BIAS = "score.bias"  # a token classifier's
CLASSIFIER_SKIP = "the sequence classifier: applied on the host (LoadedModel.pooling.classifier)"
MODULES_FILE = "modules.json"
ST_MODULE = "sentence_transformers.models."
# a Pooling config's modes jaxpaged pools by; any other set true (max, weightedmean, mean_sqrt_len) is refused
POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclasses.dataclass(frozen=True)
class PoolingInfo:
    """What a checkpoint says about pooling: the task its architecture serves and how its sentence-transformers
    config pools (None where it says nothing)."""
    task: str | None            # "embed" (*Model), "classify" (*ForSequenceClassification), "token_classify"
                                # (*ForTokenClassification), else None
    pooling_type: str | None    # "LAST", "MEAN" or "CLS" from the sentence-transformers config, else None
    normalize: bool | None      # True where modules.json has a Normalize module, False where it has none, None without modules.json
    classifier: np.ndarray | None = None   # [num_labels, hidden] float32: score.weight
    id2label: dict[int, str] | None = None  # the config's, for classifiers
    bias: np.ndarray | None = None  # [num_labels] float32: score.bias, where stored (token classifiers)


def port_architecture(name: str) -> str:
    """The architecture whose port serves `name`: a pooling architecture's CausalLM, else `name` itself."""
    return POOLING_ARCHITECTURES.get(name, (name,))[0]


def checkpoint_architecture(hf_config: Any) -> str | None:
    """The listed architecture the loader serves (registry.resolve_architecture's choice, as the checkpoint names
    it: the original of `loaded.config.architecture`)."""
    from jaxpaged.models.registry import MODEL_REGISTRY

    return next((a for a in getattr(hf_config, "architectures", None) or [] if port_architecture(a) in MODEL_REGISTRY), None)


def task(hf_config: Any) -> str | None:
    return POOLING_ARCHITECTURES.get(checkpoint_architecture(hf_config) or "", (None, None))[1]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not read {path}: {exc}") from exc


def _modules(folder: Path) -> list[dict] | None:
    """modules.json's entries (a list, or a dict holding one under "modules"), or None without the file."""
    path = folder / MODULES_FILE
    if not path.is_file():
        return None
    modules = _json(path)
    modules = modules.get("modules", []) if isinstance(modules, dict) else modules
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path} is not a list of sentence-transformers modules")
    return modules


def _pooling_type(folder: Path, module: dict) -> str | None:
    """The Pooling module's one mode; None where its config is absent or sets none."""
    path = folder / module.get("path", "") / "config.json"
    if not path.is_file():
        logger.warning("%s names a Pooling module but %s is missing: the pooling type is the engine's default", MODULES_FILE, path)
        return None
    modes = [key for key, value in _json(path).items() if key.startswith("pooling_mode_") and value is True]
    if len(modes) > 1:
        raise ValueError(f"{path} sets {', '.join(modes)}: sentence-transformers concatenates those poolings, which "
                         f"jaxpaged does not; it pools by one of {', '.join(POOLING_MODES)}")  # fmt: skip
    if modes and modes[0] not in POOLING_MODES:
        raise ValueError(f"{path} pools by {modes[0]}, which jaxpaged does not; it pools by one of {', '.join(POOLING_MODES)}")
    return POOLING_MODES[modes[0]] if modes else None


def sentence_transformers_config(folder: Path) -> tuple[bool, str | None, bool | None]:
    """(modules.json present, pooling type, normalize) as vLLM reads them; ValueError on a module that would change
    the embedding and that jaxpaged does not run (a Dense projection)."""
    modules = _modules(folder)
    if modules is None:
        return False, None, None
    kinds = {str(m.get("type", "")).removeprefix(ST_MODULE): m for m in modules}
    if "Dense" in kinds:
        raise ValueError(f"{folder / MODULES_FILE} has a sentence-transformers Dense module "
                         f"({kinds['Dense'].get('path')}): a projection after pooling that jaxpaged does not run")  # fmt: skip
    pooling = _pooling_type(folder, kinds["Pooling"]) if "Pooling" in kinds else None
    return True, pooling, "Normalize" in kinds


def _classifier(hf_config: Any, read: Callable[[str], np.ndarray] | None) -> np.ndarray:
    """score.weight as float32, checked against the config's hidden size and num_labels."""
    array = read(CLASSIFIER) if read is not None else None
    if array is None:
        raise ValueError(f"a {checkpoint_architecture(hf_config)} checkpoint needs {CLASSIFIER}, and this one has none")
    hidden, labels = int(text_config(hf_config).hidden_size), int(getattr(hf_config, "num_labels", 0) or 0)
    if array.ndim != 2 or array.shape[1] != hidden or (labels and array.shape[0] != labels):
        raise ValueError(f"{CLASSIFIER} has shape {tuple(array.shape)}, but the config implies ({labels or 'num_labels'}, {hidden})")
    return np.array(array, dtype=np.float32)


def _classifier_bias(hf_config: Any, read: Callable[[str], np.ndarray] | None, labels: int) -> np.ndarray | None:
    """score.bias as float32 where stored; a token classifier whose config says it has one must store it."""
    array = read(CLASSIFIER_BIAS) if read is not None else None
    if array is None:
        if task(hf_config) == "token_classify" and getattr(hf_config, "token_classification_bias", True):
            raise ValueError(f"a {checkpoint_architecture(hf_config)} checkpoint needs {CLASSIFIER_BIAS} "
                             f"(its config's token_classification_bias is not false), and this one has none")  # fmt: skip
        return None
    if array.shape != (labels,):
        raise ValueError(f"{CLASSIFIER_BIAS} has shape {tuple(array.shape)}, but {CLASSIFIER} implies ({labels},)")
    return np.array(array, dtype=np.float32)


def pooling_info(folder: Path | None, hf_config: Any, read: Callable[[str], np.ndarray | None] | None = None) -> PoolingInfo | None:
    """What the checkpoint in `folder` (None: a config alone) says about pooling; None where it says nothing.
    read(name): a stored tensor, None where the checkpoint has none (the classifier is read through it)."""
    kind = task(hf_config)
    found, pooling_type, normalize = sentence_transformers_config(folder) if folder is not None else (False, None, None)
    if kind is None and not found:
        return None
    classifier = id2label = bias = None
    if kind in ("classify", "token_classify"):
        classifier = _classifier(hf_config, read)
        bias = _classifier_bias(hf_config, read, classifier.shape[0])
        id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()} or None
    return PoolingInfo(kind, pooling_type, normalize, classifier, id2label, bias)


def _lacks_head(port: type, cfg: ModelConfig, stored: list[str]) -> str | None:
    """The checkpoint name of the untied head the port would read where the checkpoint stores none, else None."""
    specs = port.weight_specs(dataclasses.replace(cfg, tie_word_embeddings=False))
    head = next((name for name, spec in specs.items() if spec.paths == ("lm_head.kernel",)), None)
    present = {checkpoint_name(port, name, specs) for name in stored}
    return head if head is not None and head not in present else None


def prepare_load(folder: Path, hf_config: Any, port: type, cfg: ModelConfig, stored: list[str], ledger,
                 info: PoolingInfo | None) -> ModelConfig:  # fmt: skip
    """The port's config for a pooling checkpoint (`info`, pooling_info's, read before the weights; unchanged for any
    other): the head tied where none is stored, the classifier told to `ledger` as read on the host. stored: the
    checkpoint's tensor names as written."""
    if info is None:
        return cfg
    kind = info.task
    if getattr(text_config(hf_config), "is_causal", True) is False:  # gte-Qwen2 and alike (hf_overrides, as in vLLM)
        if not getattr(port, "BIDIRECTIONAL_POOLING", False):
            raise ValueError(f"{folder.name}: is_causal=false, a bidirectional embedding model, which the "
                             f"{cfg.architecture} port does not run (Llama, Mistral, Qwen2 and Qwen3 do)")  # fmt: skip
        logger.info("%s: is_causal=false: every prompt token attends to the whole prompt (bidirectional)", folder.name)
        cfg = dataclasses.replace(cfg, options=tuple(sorted(dict(cfg.options, bidirectional=True).items())))
    original = checkpoint_architecture(hf_config)
    logger.info("%s: a pooling checkpoint (%s%s), served by the %s port", folder.name, original,
                f", task {kind}" if kind else ", sentence-transformers modules.json", cfg.architecture)  # fmt: skip
    if kind in ("classify", "token_classify"):  # (pooling_info has read it: a checkpoint without it is refused there)
        ledger.explain(CLASSIFIER, CLASSIFIER_SKIP)
        if info.bias is not None:
            ledger.explain(CLASSIFIER_BIAS, CLASSIFIER_SKIP)
    head = None if cfg.tie_word_embeddings else _lacks_head(port, cfg, stored)
    if head is not None:
        logger.info("%s stores no %s: the LM head is tied to the embeddings (a pooling model's logits are never used)",
                    folder.name, head)  # fmt: skip
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    return cfg
