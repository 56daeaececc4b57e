"""LoRA adapters (PEFT's format) on a Llama-family port, many at once in one jitted step.

Up to `max_loras` adapters are resident as one pair of stacked arrays per target projection: A_all [in, L * R] and
B_all [L * R, out], slot s in columns (rows of B) s * R to (s + 1) * R, each adapter's rank zero-padded to R =
max_lora_rank and its scaling (alpha / r, or alpha / sqrt(r) with rslora) folded into B at load. A step computes
h = x @ A_all for every token, zeroes the columns of slots other than the token's own (a mask from the per-token
slot index, -1: none), and adds h @ B_all: fixed shapes whatever adapters are resident, no gather, no Python loop
over adapters, so loading or evicting one only rewrites its slot's rows.

The arrays are not the model's parameters: the runner passes them as an operand of the step and `active()` puts
them (with the step's slots) where each wrapped projection (`LoRALinear`) finds them while the step is traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.accounting import shown
from jaxpaged.models.config import ModelConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
_PREFIX = "base_model.model."  # PEFT's tensor names: this, the base model's module name, .lora_A/B.weight
# PEFT features that change the arithmetic beyond x @ A @ B * scaling: refused rather than silently ignored
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
                "alpha_pattern": "alpha_pattern", "fan_in_fan_out": "fan_in_fan_out",
                "target_parameters": "target_parameters"}  # fmt: skip


def _port_projections(cfg: ModelConfig):
    """A port's own `lora_projections` (hybrid models: attention and MLP on some layers only), or None."""
    from jaxpaged.models.registry import MODEL_REGISTRY

    return getattr(MODEL_REGISTRY.get(cfg.architecture), "lora_projections", None)


def check_architecture(cfg: ModelConfig) -> None:
    if cfg.architecture not in SUPPORTED_ARCHITECTURES and _port_projections(cfg) is None:
        from jaxpaged.models.registry import MODEL_REGISTRY

        supported = [*SUPPORTED_ARCHITECTURES, *(a for a, port in MODEL_REGISTRY.items() if hasattr(port, "lora_projections"))]
        raise ValueError(f"enable_lora: LoRA adapters are supported for {', '.join(supported)}; "
                         f"this model is a {cfg.architecture}")  # fmt: skip


def projections(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int]]]:
    """Every projection an adapter may adapt: its key (our module path, "layers.3.self_attn.q_proj") -> (the base
    model's module as PEFT names it, (in, out) features). Llama's layers each have q/k/v/o and gate/up/down; a port
    laid out otherwise says where its are (`lora_projections`)."""
    custom = _port_projections(cfg)
    if custom is not None:
        return custom(cfg)
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    io = {"q_proj": (d, cfg.num_heads * hd), "k_proj": (d, cfg.num_kv_heads * hd), "v_proj": (d, cfg.num_kv_heads * hd),
          "o_proj": (cfg.num_heads * hd, d), "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip
    return {f"layers.{i}.{_BLOCK[t]}.{t}": (f"model.layers.{i}.{_BLOCK[t]}.{t}", io[t])
            for i in range(cfg.num_layers) for t in LORA_TARGETS}  # fmt: skip


def parse_targets(spec: str | None) -> tuple[str, ...]:
    """lora_target_modules ("q_proj,v_proj"; None: all seven) -> the projections that get stacked arrays."""
    if spec is None:
        return LORA_TARGETS
    names = tuple(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown or not names:
        raise ValueError(f"lora_target_modules must name some of {', '.join(LORA_TARGETS)} (got {spec!r})")
    return names


def target_shapes(cfg: ModelConfig, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Every wrapped projection's key (its module path, "layers.3.self_attn.q_proj") -> (in, out) features."""
    return {key: io for key, (_, io) in projections(cfg).items() if key.rsplit(".", 1)[-1] in targets}


# -- adapters on the host -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LoRAAdapter:
    """One adapter as loaded: per projection key, A [in, r] and B [r, out] with the scaling folded in (float32)."""

    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def resolve_adapter_folder(path: str) -> Path:
    """A local folder, or a hub id found in the Hugging Face cache (models/hub.py)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    from jaxpaged.models import hub

    if hub.is_hub_id(str(path)):
        try:
            return Path(hub.snapshot_folder(str(path)))
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"lora_path {path!r}: {exc}") from None
    raise ValueError(f"lora_path {path!r} is not a folder (a PEFT adapter: adapter_config.json and adapter_model.safetensors)")


def _read_config(folder: Path, path: str) -> dict:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"lora_path {path!r} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora_path {path!r}: adapter_config.json is not valid JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path {path!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"lora_path {path!r}: adapters with {what} are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"lora_path {path!r}: adapters that train biases (bias={config['bias']!r}) are not supported")
    return config


def _read_tensors(folder: Path, path: str) -> dict[str, np.ndarray]:
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        if any(folder.glob("*.bin")):
            raise ValueError(f"lora_path {path!r} holds only a pickle .bin file, which is never loaded (it can run code); "
                             "save the adapter as adapter_model.safetensors (PEFT's default)")  # fmt: skip
        raise ValueError(f"lora_path {path!r} has no adapter_model.safetensors")
    from safetensors import safe_open

    try:
        with safe_open(weights, framework="flax") as f:  # flax, not numpy: bfloat16 adapters too
            return {name: np.asarray(f.get_tensor(name), np.float32) for name in f.keys()}
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"lora_path {path!r}: adapter_model.safetensors cannot be read ({exc})") from None


def _targeted(config: dict, module: str) -> bool:
    """Whether PEFT puts a LoRA on the base model's `module` ("model.layers.0.self_attn.q_proj"), as its
    check_target_module_exists decides from the adapter's config (so each one must have lora_A and lora_B)."""
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, module):
        return False
    if isinstance(exclude, (list, tuple)) and (module in exclude or any(module.endswith(f".{e}") for e in exclude)):
        return False
    wanted = config.get("target_modules")
    if isinstance(wanted, str):
        return wanted.lower() == "all-linear" or re.fullmatch(wanted, module) is not None
    if module in wanted:
        return True
    if not any(module.endswith(f".{t}") for t in wanted):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern") or [r"[^.]*"]
    patterns = [patterns] if isinstance(patterns, str) else patterns
    match = next((m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module))), None)
    return match is not None and int(match["idx"]) in ([layers] if isinstance(layers, int) else layers)


def _check_tensor_names(config: dict, stored: list[str], cfg: ModelConfig, path: str) -> None:
    """Every stored tensor is a LoRA of a supported projection, and every projection the config targets has both;
    else one ValueError naming the tensors."""
    if not isinstance(config.get("target_modules"), (str, list, tuple)):
        raise ValueError(f"lora_path {path!r}: adapter_config.json names no target_modules")
    modules = [module for module, _ in projections(cfg).values()]
    expected = [f"{_PREFIX}{m}.lora_{ab}.weight" for m in modules if _targeted(config, m) for ab in "AB"]
    unknown = sorted(set(stored) - set(expected))
    missing = sorted(set(expected) - set(stored))
    problems = []
    if unknown:
        problems.append(f"adapter_model.safetensors holds {len(unknown)} tensor(s) that are not the lora_A / lora_B of a "
                        f"q/k/v/o or gate/up/down projection its target_modules name in the {cfg.num_layers}-layer base: "
                        f"{shown(unknown)}")  # fmt: skip
    if missing:
        problems.append(f"it lacks {len(missing)} tensor(s) its target_modules imply: {shown(missing)}")
    if problems:
        raise ValueError(f"lora_path {path!r}: {'; '.join(problems)}")


def load_adapter(name: str, path: str, cfg: ModelConfig, targets: tuple[str, ...], max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter against the base model; a ValueError naming the problem otherwise."""
    check_architecture(cfg)
    folder = resolve_adapter_folder(path)
    config = _read_config(folder, path)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_path {path!r}: r must be a positive integer (got {rank!r})")
    if rank > max_rank:
        raise ValueError(f"lora_path {path!r}: its rank r={rank} exceeds max_lora_rank ({max_rank})")
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_path {path!r}: lora_alpha must be a number (got {alpha!r})")
    wanted = config.get("target_modules")
    if isinstance(wanted, (list, tuple)):  # projection names, or module paths (PEFT writes "all-linear" so)
        unknown = [m for m in wanted if m.rsplit(".", 1)[-1] not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"lora_path {path!r}: target_modules {unknown} are not supported (only {', '.join(LORA_TARGETS)})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = target_shapes(cfg, LORA_TARGETS)
    keys = {f"{_PREFIX}{module}": key for key, (module, _) in projections(cfg).items()}
    pieces: dict[str, dict[str, np.ndarray]] = {}
    tensors = _read_tensors(folder, path)
    _check_tensor_names(config, list(tensors), cfg, path)
    for tensor_name, value in tensors.items():
        owner, _, leaf = tensor_name.rpartition(".lora_")  # (every name checked above: <module>.lora_A/B.weight)
        key, ab = keys[owner], leaf[0]
        module = key.rsplit(".", 1)[-1]
        if module not in targets:
            raise ValueError(f"lora_path {path!r} adapts {module}, which is not in the engine's lora_target_modules "
                             f"({', '.join(targets)})")  # fmt: skip
        pieces.setdefault(key, {})[ab] = value
    if not pieces:
        raise ValueError(f"lora_path {path!r}: adapter_model.safetensors holds no LoRA tensors")
    weights = {}
    for key, ab in pieces.items():
        fan_in, fan_out = shapes[key]
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(f"lora_path {path!r}: {key}'s lora_A {a.shape} / lora_B {b.shape} do not fit the base model "
                             f"(expected ({rank}, {fan_in}) / ({fan_out}, {rank})): an adapter for another base?")  # fmt: skip
        weights[key] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T) * np.float32(scaling))
    return LoRAAdapter(name, rank, scaling, weights)


# -- the stacked arrays on the device -------------------------------------------------------------------------------


def empty_weights(shapes: dict[str, tuple[int, int]], max_loras: int, max_rank: int, dtype) -> dict[str, tuple]:
    """All slots empty (zeros): key -> (A_all [in, L * R], B_all [L * R, out])."""
    width = max_loras * max_rank
    return {key: (jnp.zeros((i, width), dtype), jnp.zeros((width, o), dtype)) for key, (i, o) in shapes.items()}


def slot_arrays(adapter: LoRAAdapter | None, shapes: dict[str, tuple[int, int]], max_rank: int, dtype,
                kv_repeat: tuple[int, int] = (1, 0)) -> dict[str, tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """One slot's rows of every stacked array: the adapter's A/B zero-padded to max_rank (zeros where it does not
    adapt a projection; all zeros for None). kv_repeat (factor, head_dim): k/v columns repeated as tensor parallelism
    widened the base's KV heads (models/sharding.py)."""
    factor, head_dim = kv_repeat
    out = {}
    for key, (fan_in, fan_out) in shapes.items():
        a = np.zeros((fan_in, max_rank), np.float32)
        b = np.zeros((max_rank, fan_out), np.float32)
        if adapter is not None and key in adapter.weights:
            a_r, b_r = adapter.weights[key]
            if factor > 1 and key.endswith(("k_proj", "v_proj")):
                b_r = np.repeat(b_r.reshape(b_r.shape[0], -1, head_dim), factor, axis=1).reshape(b_r.shape[0], -1)
            a[:, : a_r.shape[1]], b[: b_r.shape[0]] = a_r, b_r
        out[key] = (a.astype(dtype), b.astype(dtype))
    return out


def write_slot(weights: dict, slot: jax.Array, arrays: dict) -> dict:
    """Slot `slot`'s rows of every stacked array replaced (jitted with the weights donated: one shape, any slot)."""
    rank = next(iter(arrays.values()))[0].shape[1]
    start = slot * rank
    return {
        key: (jax.lax.dynamic_update_slice(a_all, arrays[key][0], (0, start)),
              jax.lax.dynamic_update_slice(b_all, arrays[key][1], (start, 0)))
        for key, (a_all, b_all) in weights.items()
    }  # fmt: skip


def weight_shardings(mesh, weights: dict) -> dict:
    """Under tensor parallelism A and B split as their base weight: column-parallel projections split B's columns
    (A replicated), row-parallel ones A's rows (B replicated), so x @ A_all meets x's split as the kernel does."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpaged.models.sharding import ROW_PARALLEL
    from jaxpaged.pallas_kernels.attention import TP_AXIS

    def specs(key):
        if key.rsplit(".", 1)[-1] in ROW_PARALLEL:
            return P(TP_AXIS, None), P()
        return P(), P(None, TP_AXIS)

    return {key: tuple(NamedSharding(mesh, s) for s in specs(key)) for key in weights}


# -- in the step ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Batch:
    weights: dict
    mask: jax.Array  # [T, L * R] bool: the columns of each token's own slot


_ACTIVE: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("jaxpaged_lora", default=None)


def token_mask(token_slots: jax.Array, max_loras: int, max_rank: int) -> jax.Array:
    """[T] slot per token (-1: none) -> [T, L * R], True where a column belongs to the token's slot."""
    column_slot = jnp.arange(max_loras * max_rank, dtype=jnp.int32) // max_rank
    return token_slots[:, None] == column_slot[None, :]


@contextlib.contextmanager
def active(weights: dict, token_slots: jax.Array, max_loras: int, max_rank: int):
    """While a step is traced: the stacked arrays and this step's slots, for the wrapped projections."""
    token = _ACTIVE.set(_Batch(weights, token_mask(token_slots, max_loras, max_rank)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _precision(x):
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


@dataclasses.dataclass(frozen=True)
class LoRALinear:
    """A projection's method plus the batched LoRA delta: its own method's x @ W, then (x @ A_all masked) @ B_all.
    Outside `active()` (or for a projection the stacked arrays do not cover) it is the wrapped method alone."""

    inner: Any
    key: str

    def apply(self, layer, x: jax.Array) -> jax.Array:
        y = self.inner.apply(layer, x)
        batch = _ACTIVE.get()
        if batch is None or self.key not in batch.weights:
            return y
        a_all, b_all = batch.weights[self.key]
        h = jnp.dot(x, a_all, precision=_precision(x), preferred_element_type=jnp.float32)
        h = jnp.where(batch.mask, h, 0.0).astype(b_all.dtype)
        return y + jnp.dot(h, b_all, precision=_precision(h), preferred_element_type=jnp.float32)


def attach(model: nnx.Module, targets: tuple[str, ...]) -> int:
    """Wrap the method of every target projection of the model (after the platform chose its methods); -> how many."""
    count = 0
    for path, module in nnx.iter_modules(model):
        key = ".".join(str(p) for p in path)
        if path and str(path[-1]) in targets and hasattr(module, "method") and hasattr(module, "kernel"):
            if not isinstance(module.method, LoRALinear):
                module.method = LoRALinear(module.method, key)
                count += 1
    return count
