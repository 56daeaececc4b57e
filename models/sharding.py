"""Tensor parallelism: a 1-D `jax.sharding.Mesh` over N devices (axis "model") and every parameter's
NamedSharding, derived from its path alone in one place. The ports share parameter names
(models/layers.py), so the rules below cover every family:

- column-parallel (output features split): q_proj, k_proj, v_proj, gate_proj, up_proj, and their biases (and
  fuse_projections' qkv_proj and gate_up_proj, whose columns are grouped by device);
- row-parallel (input features split): o_proj, down_proj; their biases are replicated (added once,
  after GSPMD's all-reduce of the partial sums);
- vocabulary-parallel: embed_tokens rows and lm_head columns, when the vocabulary divides by N;
- stacked MoE experts (models/moe.py): over the expert axis when N divides the expert count (expert
  parallelism), else over each expert's intermediate features;
- everything else (norms, position tables, OPT's projections, MoE routers) is replicated, and so are vision towers
  and projectors (models/vision/).

Attention heads split with q/k/v's columns; the KV-block array splits on its KV-head axis. A model
with fewer KV heads than N has each KV head's k/v columns repeated N / H_kv times first, so every
device still holds (and caches) exactly one KV head. A model whose layers differ in KV heads and head dim
(Gemma 4: the option "layer_kv_shapes", each layer's (KV heads, head dim)) has each layer checked and widened on
its own (a layer with fewer KV heads than N repeated to N), the cache keeping its largest count (or N), which each
layer's forward repeats its heads up to. GSPMD partitions the matmuls from these input shardings; attention
itself runs under shard_map (pallas_kernels/attention.py).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.moe import check_experts_divisible, expert_partition_spec
from jaxpaged.pallas_kernels.attention import TP_AXIS
from jaxpaged.pallas_kernels.kv_quant import QuantizedKV
from jaxpaged.pallas_kernels.state_cache import HybridCache, StateArray, StateSpec, StateUpdate

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# fuse_projections' fused Linears (models/fused_projections.py): their columns grouped so that a split of N gives each
# device its own q/k/v heads and gate/up columns
COLUMN_PARALLEL += ("qkv_proj", "gate_up_proj")
# vision towers and projectors (models/vision/) stay whole on every device: they run once per image, beside the
# language model, and their heads need not divide by N
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.", "embed_vision.")
ROW_PARALLEL = ("o_proj", "down_proj")
# hybrid models' linear layers (models/qwen3_next.py, models/nemotron_h.py): their projections split by head (q, k, v,
# the gate z, b, a, Mamba's x and dt), out_proj by its input; the convolutions by channel, which follow the heads; the
# per-head parameters (dt_bias, A_log, D) and Mamba's grouped norm by head. Mamba's B and C (a group's, read by its
# heads) stay whole: small, and whole on every device whatever n_groups and N are.
# MLA (models/deepseek.py): q_b_proj and the latent's up-projection kv_b_proj split by head; the latent's own
# projections (q_a_proj, kv_a_proj_with_mqa) and norms stay whole, and so does its cache (a copy per device)
COLUMN_PARALLEL += ("q_b_proj", "kv_b_proj")
COLUMN_PARALLEL += ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_x", "in_proj_dt")
ROW_PARALLEL += ("out_proj",)
SPLIT_CONVOLUTIONS = ("conv_q", "conv_k", "conv_v", "conv_x")
PER_HEAD = ("dt_bias", "A_log", "D")
PER_HEAD += ("sinks",)  # GPT-OSS's attention sinks [H]: each device's query heads' (stacked expert biases: models/moe.py)


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} {devices[0].platform} device(s) "
            "are visible (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,), axis_types=(AxisType.Auto,))


def check_divisible(cfg: ModelConfig, n: int) -> None:
    """A ValueError naming the first size that cannot be split n ways (or why the model does not split at all)."""
    if n > 1 and cfg.option("no_tensor_parallel"):
        raise ValueError(f"tensor_parallel_size={n}: {cfg.option('no_tensor_parallel')}")
    if cfg.option("moe") is not None:
        check_experts_divisible(cfg, n)
    if n > cfg.num_kv_heads and cfg.option("whole_width_qk_norm"):  # OLMo 2/3, OLMoE, MiniMax-M2 (models/olmoe.py)
        raise ValueError(
            f"tensor_parallel_size={n} is more than this {cfg.architecture}'s {cfg.num_kv_heads} KV heads: its k norm "
            "spans every KV head's features, so they cannot be repeated across devices; use at most "
            f"{cfg.num_kv_heads} devices"
        )
    problems = []
    if cfg.num_heads % n:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} (neither divisible by it nor dividing it)")
    uneven = sorted({kv for kv, _ in cfg.option("layer_kv_shapes", ()) if kv % n and n % kv} - {cfg.num_kv_heads})
    problems += [f"some layers' {kv} KV heads (neither divisible by it nor dividing it)" for kv in uneven]
    if cfg.intermediate_size % n:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    for option, fields in (("gdn", ("num_k_heads", "num_v_heads")), ("mamba", ("num_heads",))):
        sizes = dict(cfg.option(option) or ())  # a hybrid model's linear layers split by head too
        problems += [f"its linear layers' {name}={sizes[name]}" for name in fields if name in sizes and sizes[name] % n]
    if problems:
        raise ValueError(
            f"tensor_parallel_size={n} does not divide this {cfg.architecture}'s {', '.join(problems)}; "
            "choose a tensor_parallel_size that divides the head count"
        )


def partition_spec(path: str, shape: tuple[int, ...], n: int) -> P:
    """The PartitionSpec of the parameter at dotted `path` (e.g. "layers.3.self_attn.q_proj.kernel")."""
    if path.startswith(VISION_PREFIXES):
        return P()
    parts = path.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    if len(parts) > 2 and parts[-3] == "experts":  # stacked MoE experts [E, in, out]: over experts, or their features
        return expert_partition_spec(module, parts[-1], shape, n)
    # A quantized projection's scales and offsets (models/quantization.py) split like its kernel: [out] per
    # channel, [in / group, out] per group; a packed 4-bit kernel [in / 2, out] splits on the same axis.
    if module in COLUMN_PARALLEL:
        return P(None, TP_AXIS) if len(shape) == 2 else P(TP_AXIS)
    if module in ROW_PARALLEL:
        return P(TP_AXIS, None) if len(shape) == 2 else P()
    if module in SPLIT_CONVOLUTIONS:  # weight [K, C], bias [C]
        return P(None, TP_AXIS) if len(shape) == 2 else P(TP_AXIS)
    if parts[-1] in PER_HEAD or path.endswith("mixer.norm.scale"):
        return P(TP_AXIS)
    if path == "embed_tokens.embedding" and shape[0] % n == 0:
        return P(TP_AXIS, None)
    if path == "lm_head.kernel" and shape[1] % n == 0:
        return P(None, TP_AXIS)
    if path in ("lm_head.bias", "lm_head_bias") and shape[0] % n == 0:
        return P(TP_AXIS)
    return P()


def dotted_path(keypath) -> str:
    names = []
    for key in keypath:
        name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))
        if name != "value":
            names.append(str(name))
    return ".".join(names)


def replicate_kv_heads(state, cfg: ModelConfig, n: int):
    """Repeat each KV head's k/v columns n / H_kv times, so n devices each get one: -> (state, cfg). With
    "layer_kv_shapes", per layer (its own KV heads and head dim); the cache's count becomes max(H_kv, n)."""
    layer_shapes = cfg.option("layer_kv_shapes")
    smallest = min(kv for kv, _ in layer_shapes) if layer_shapes else cfg.num_kv_heads
    if smallest >= n:
        return state, cfg

    def widen(keypath, x):
        path = dotted_path(keypath)
        if path.startswith(VISION_PREFIXES):
            return x
        if not path.endswith(tuple(f".{p}.{leaf}" for p in ("k_proj", "v_proj") for leaf in ("kernel", "bias", "scale", "zero"))):
            return x
        kv, hd = cfg.num_kv_heads, cfg.head_dim
        if layer_shapes:
            kv, hd = layer_shapes[int(re.search(r"(?:^|\.)layers\.(\d+)\.", path)[1])]
        if kv >= n:
            return x
        heads = x.reshape(*x.shape[:-1], kv, hd)
        return jnp.repeat(heads, n // kv, axis=-2).reshape(*x.shape[:-1], n * hd)

    return jax.tree_util.tree_map_with_path(widen, state), dataclasses.replace(cfg, num_kv_heads=max(cfg.num_kv_heads, n))


def param_sharding(mesh: Mesh, path: str, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(path, tuple(shape), mesh.shape[TP_AXIS]))


def param_shardings(state, mesh: Mesh):
    return jax.tree_util.tree_map_with_path(lambda keypath, x: param_sharding(mesh, dotted_path(keypath), x.shape), state)


def shard_params(state, cfg: ModelConfig, mesh: Mesh):
    """Check the sizes split, widen KV heads if needed, and place every parameter: -> (state, cfg)."""
    n = mesh.shape[TP_AXIS]
    check_divisible(cfg, n)
    state, cfg = replicate_kv_heads(state, cfg, n)
    return jax.device_put(state, param_shardings(state, mesh)), cfg


def kv_cache_sharding(mesh: Mesh, kv_cache_dtype: str = "auto"):
    """[layers, 2, blocks, KV heads, block_size, head_dim]: split on the KV-head axis (an 8-bit cache's scales,
    [layers, 2, blocks, KV heads, block_size], with it)."""
    data = NamedSharding(mesh, P(None, None, None, TP_AXIS, None, None))
    if kv_cache_dtype == "auto":
        return data
    return QuantizedKV(data, NamedSharding(mesh, P(None, None, None, TP_AXIS, None)), kv_cache_dtype)


def state_partition_spec(array: StateArray) -> P:
    """A state array of a hybrid model's cache, [linear layers, slots, ...] (or a step's [layers, rows, ...]): split
    where StateArray.split_axis says (heads, or a convolution's channels), else whole."""
    axes = [None] * (2 + len(array.shape))
    if array.split_axis is not None:
        axes[2 + array.split_axis] = TP_AXIS
    return P(*axes)


def hybrid_cache_sharding(mesh: Mesh, spec: StateSpec, kv_cache_dtype: str = "auto") -> HybridCache:
    """A HybridCache's shardings: the KV array's, and each state array's (state_partition_spec)."""
    states = {a.name: NamedSharding(mesh, state_partition_spec(a)) for a in spec.arrays}
    return HybridCache(kv_cache_sharding(mesh, kv_cache_dtype), states)


def state_update_sharding(mesh: Mesh, spec: StateSpec) -> StateUpdate:
    """A hybrid model's step output for the write: the new K/V as new_kv_sharding, the states as in the cache."""
    states = {a.name: NamedSharding(mesh, state_partition_spec(a)) for a in spec.arrays}
    return StateUpdate(new_kv_sharding(mesh), states, NamedSharding(mesh, P()))


def new_kv_sharding(mesh: Mesh) -> NamedSharding:
    """A step's new K/V, [T, layers, 2, KV heads, head_dim]: split like the cache."""
    return NamedSharding(mesh, P(None, None, None, TP_AXIS, None))
