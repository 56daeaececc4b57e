"""Replacing a running engine's weights in place, from new ones already on the devices (issue 47).

New weights arrive named by the port's parameter paths (an NNX State of the port: `layers.0.self_attn.q_proj.kernel`,
[in, out]) or by HF tensor names (`model.layers.0.self_attn.q_proj.weight`, torch's [out, in]), or by a trainer's own
names through a mapping onto either. Each goes to the layout the loader gives (the port's WeightSpecs: transposes,
fused-QKV splits; the engine's dtype; int8/fp8 per-channel quantization), then through the very code that laid the
loaded weights out at start-up (ModelRunner.prepare_weights: the CPU's packed panels, a tied head's transposed
copy, ...) and onto each parameter's sharding, all in one jitted program on the devices: no host round trip. The
result has the shapes, dtypes and shardings the compiled steps were built for, so no step compiles again; the
update's own program compiles once per set of names and input shapes, and later updates of that set reuse it.

Which laid-out parameters an update touches is read off that program's jaxpr: one is recomputed when an input it
depends on changed, and needs all its inputs given (a platform that laid two parameters out together would need
both). One that is a loaded parameter as it is (a norm's scale; every weight on a platform that repacks nothing,
as a GPU) takes the given array itself where its dtype and sharding already match: a pointer swap, as Tunix's own
rollout does (the caller must then not donate that array to a later computation).

Everything is checked before anything changes: unknown names and wrong shapes are one ValueError naming them, and
the engine keeps its weights. MXFP4 expert weights an engine keeps 4-bit (moe_kernel="triton": packed codes and
scales loaded once from the checkpoint) are refused by name: an update cannot re-encode them, so an engine that
updates expert weights starts with moe_kernel="loop" or quantization="none" (experts dequantized at load); the same
engine's other weights, the experts' biases among them, update as ever.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import types
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.accounting import shown
from jaxpaged.models.weights import WeightSpec, checkpoint_name
from jaxpaged.utils import compile_monitor

logger = logging.getLogger("jaxpaged.weights")

HEAD_PATH, EMBEDDING_PATH = "lm_head.kernel", "embed_tokens.embedding"
EIGHT_BIT = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)

# mapping: {trainer name: engine name, or (engine name, fn on the array), or None (not a weight: skipped)}, or a
# callable from a trainer name to the same; names a dict does not hold pass through as they are
Mapping_ = Mapping[str, Any] | Callable[[str], Any] | None


def dotted(keypath) -> str:
    """A pytree key path as a dotted name ("layers.0.self_attn.q_proj.kernel"); NNX Variables' `value` left out."""
    names = []
    for key in keypath:
        name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))
        if name not in ("value", "raw_value"):
            names.append(str(name))
    return ".".join(names)


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedLayout:
    """A model's parameters as the loader left them, before the runner laid them out: shapes and dtypes only."""

    graphdef: Any
    treedef: Any
    paths: tuple[str, ...]
    avals: tuple[jax.ShapeDtypeStruct, ...]
    port: type
    config: Any  # ModelConfig, before tensor parallelism widens KV heads

    @classmethod
    def of(cls, loaded) -> LoadedLayout:
        return cls.of_model(loaded.model, loaded.config)

    @classmethod
    def of_model(cls, model: nnx.Module, config) -> LoadedLayout:
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        return cls(graphdef, treedef, tuple(dotted(kp) for kp, _ in leaves),
                   tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in leaves), type(model), config)  # fmt: skip

    @functools.cached_property
    def index(self) -> dict[str, int]:
        return {path: i for i, path in enumerate(self.paths)}

    @functools.cached_property
    def specs(self) -> dict[str, WeightSpec]:
        """HF tensor name -> spec, the loader's; a tied model's head name reads as the embedding table (its copy)."""
        specs = dict(self.port.weight_specs(self.config))
        if self.config.tie_word_embeddings:
            untied = self.port.weight_specs(dataclasses.replace(self.config, tie_word_embeddings=False))
            for name, spec in untied.items():
                if spec.paths == (HEAD_PATH,) and name not in specs:
                    specs[name] = WeightSpec(EMBEDDING_PATH)
        return specs

    @functools.cached_property
    def head_aliases(self) -> frozenset[str]:
        """A tied model's head names: skipped where the embedding table is given too."""
        own = self.port.weight_specs(self.config)
        return frozenset(n for n, s in self.specs.items() if n not in own and s.paths == (EMBEDDING_PATH,))


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One given tensor: how it becomes loaded-layout parameters (indices into LoadedLayout.paths)."""

    given: int  # index into the program's inputs
    targets: tuple[int, ...]
    transpose: bool = False
    split: Callable | None = None
    ops: tuple[str, ...] = ()  # per target: "keep", "cast" or "quantize:<int8|fp8>" (the target's scale follows it)
    fn: Callable | None = None  # a mapping's function on the given array, first (traced into the program)


@dataclasses.dataclass
class _Plan:
    entries: list[_Entry]
    inputs: list
    given: set[int]  # the loaded-layout parameters it sets
    touched: list[int]  # the runner's parameters it replaces
    started: float
    copy: bool = False


def named_arrays(weights, mapping: Mapping_ = None) -> list[tuple[str, str, Any, Callable | None]]:
    """(name as given, the engine's name for it, array, the mapping's function for it or None) for every leaf of
    `weights` (a dict by name, nested or dotted, an NNX State, any pytree); a mapping renames them (and may name a
    function to apply first), or skips them with None."""
    if isinstance(weights, nnx.Module):
        weights = nnx.state(weights, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(weights)[0]
    out = []
    for keypath, array in flat:
        name = dotted(keypath)
        target: Any = name
        if callable(mapping):
            target = mapping(name)
        elif mapping is not None:
            target = mapping.get(name, name)
        if target is None:
            continue
        fn = None
        if isinstance(target, tuple):
            target, fn = target
        out.append((name, str(target), array, fn))
    return out


def quantize_channels(w: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """models/quantization.py's quantize_channels on the device (traced): per output channel, over the input axis
    (-2), so stacked experts [E, in, out] get a scale per expert and channel as they do at load."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-2)
    qmax, dtype = (127.0, jnp.int8) if kind == "int8" else (FP8_MAX, jnp.float8_e4m3fn)
    # a true division, as numpy's: XLA turns one by a constant into a product by its reciprocal (1 ulp off)
    qmax = jax.lax.optimization_barrier(jnp.full_like(amax, qmax))
    scale = jnp.maximum(amax / qmax, jnp.finfo(jnp.float32).tiny).astype(jnp.float32)
    q = w / scale[..., None, :]
    q = jnp.clip(jnp.round(q), -127, 127) if kind == "int8" else jnp.clip(q, -FP8_MAX, FP8_MAX)
    return q.astype(dtype), scale


def resolve(layout: LoadedLayout, named: list[tuple], what: str = "update_weights") -> tuple[list[_Entry], list, set[int]]:
    """Named tensors or their shapes ((given name, engine name, array, fn or None), as named_arrays makes them) as
    _Entries over the loaded layout, the arrays, and the loaded-layout parameters they set; or one ValueError naming
    every problem."""
    specs = layout.specs
    resolved = []
    for given, target, array, fn in named:
        if fn is not None:  # checked as what the function makes of it
            shaped = jax.eval_shape(fn, jax.ShapeDtypeStruct(tuple(array.shape), array.dtype))
        else:
            shaped = array
        if target in layout.index:
            resolved.append((given, target, array, fn, shaped, (target,), False, None))
            continue
        name = checkpoint_name(layout.port, target, specs)
        spec = specs.get(name)
        resolved.append((given, target, array, fn, shaped, None if spec is None else spec.paths,
                         False if spec is None else spec.transpose, None if spec is None else spec.split))  # fmt: skip
    embeddings_given = any(r[5] == (EMBEDDING_PATH,) and r[1] not in layout.head_aliases for r in resolved)
    problems, entries, inputs, owner = [], [], [], {}
    for given, target, array, fn, shaped, paths, transpose, split in resolved:
        label = given if given == target else f"{given} (as {target})"
        if paths is None:
            problems.append(f"unknown tensor {label}: no parameter of this {layout.config.architecture} has that name")
            continue
        if target in layout.head_aliases and embeddings_given:
            continue  # a tied model's head beside its embeddings: the copy
        shape = tuple(getattr(shaped, "shape", ()))
        targets = [layout.index[p] for p in paths]
        packed = [layout.paths[i] for i in targets if mxfp4_packed(layout, layout.paths[i])]
        if packed:
            problems.append(f"tensor {label} sets {', '.join(packed)}: MXFP4 expert weights this engine keeps 4-bit "
                            "(uint8 codes and scales in the grouped GEMM's layout, loaded once from the checkpoint's "
                            "_blocks/_scales), which an update cannot re-encode; to update expert weights, start the "
                            "engine with moe_kernel='loop' or quantization='none' (its experts are then dequantized once "
                            "at load, in the engine's dtype)")  # fmt: skip
            continue
        want = [tuple(layout.avals[i].shape) for i in targets]
        if split is not None:
            expect = want[0][:-1] + (sum(s[-1] for s in want),)
        else:
            expect = want[0]
        if transpose:
            expect = expect[::-1]
        if shape != expect:
            problems.append(f"tensor {label} has shape {shape}, but the engine's {', '.join(paths)} needs {expect}")
            continue
        ops, extra = [], []
        src = jnp.dtype(getattr(shaped, "dtype", np.float32))
        for i in targets:
            dst = layout.avals[i].dtype
            op = conversion(layout, src, dst, layout.paths[i])
            if op is None:
                problems.append(f"tensor {label} is {src.name}, which cannot become the engine's {dst.name} "
                                f"{layout.paths[i]}")  # fmt: skip
                break
            ops.append(op)
            if op.startswith("quantize"):
                extra.append(layout.index[layout.paths[i].rpartition(".")[0] + ".scale"])
        else:
            for i in [*targets, *extra]:
                if i in owner:
                    problems.append(f"tensor {label} and {owner[i]} both set {layout.paths[i]}")
                owner[i] = label
            entries.append(_Entry(len(inputs), tuple(targets), transpose, split, tuple(ops), fn))
            inputs.append(array)
    if problems:
        raise ValueError(f"{what}: {len(problems)} problem(s), nothing was changed: " + shown(problems))
    if not entries:
        raise ValueError(f"{what}: no tensors given (after the mapping)")
    return entries, inputs, set(owner)


def mxfp4_packed(layout: LoadedLayout, path: str) -> bool:
    """Whether a loaded-layout parameter is an MXFP4 expert weight kept 4-bit (models/moe.py ExpertLinear.load_mxfp4:
    its kernel holds packed codes beside an mx_scale): one an update must not set, whatever it is given."""
    owner, _, leaf = path.rpartition(".")
    return leaf in ("kernel", "mx_scale") and f"{owner}.mx_scale" in layout.index


def conversion(layout: LoadedLayout, src, dst, path: str) -> str | None:
    """How a given dtype becomes a loaded-layout one: kept, cast, quantized per channel (the engine's weights
    are 8-bit where the given are floats), or impossible (None)."""
    if src == dst:
        return "keep"
    floating = jnp.issubdtype(src, jnp.floating)
    if jnp.issubdtype(dst, jnp.floating) and dst not in EIGHT_BIT:
        return "cast" if floating else None
    scale = path.rpartition(".")[0] + ".scale"
    if dst in EIGHT_BIT and floating and path.endswith(".kernel") and scale in layout.index:
        return "quantize:" + ("int8" if dst == jnp.dtype(jnp.int8) else "fp8")
    return None


def loaded_values(layout: LoadedLayout, entries: list[_Entry], values: dict[int, Any]) -> list:
    """The loaded-layout parameters the entries make from their values (by entry.given; traced): transposed, split,
    cast or quantized as the loader would; None where no entry sets one."""
    raw: list = [None] * len(layout.avals)
    for e in entries:
        if e.given not in values:
            continue
        x = values[e.given]
        if e.fn is not None:
            x = e.fn(x)
        if e.transpose:
            x = jnp.swapaxes(x, -1, -2)
        parts = e.split(x) if e.split is not None else (x,)
        for i, part, op in zip(e.targets, parts, e.ops):
            if op.startswith("quantize"):
                scale = layout.index[layout.paths[i].rpartition(".")[0] + ".scale"]
                raw[i], raw[scale] = quantize_channels(part, op.split(":")[1])
            else:
                raw[i] = part.astype(layout.avals[i].dtype)
    return raw


def fill_model(model: nnx.Module, config, named: list[tuple], *, what: str, sharding: Callable[[str, tuple], Any]) -> set[int]:
    """Fill an abstract model (parameters still shapes, as the loader builds it) from named arrays on the devices, as
    update_weights names them, in one jitted program (each parameter onto sharding(path, shape)); a ValueError names
    the tensors it cannot place and the parameters none gives. -> the loaded-layout parameters set."""
    layout = LoadedLayout.of_model(model, config)
    entries, inputs, given = resolve(layout, named, what=what)
    abstract = jax.tree_util.tree_leaves(nnx.split(model)[1])
    missing = [layout.paths[i] for i, leaf in enumerate(abstract) if i not in given and isinstance(leaf, jax.ShapeDtypeStruct)]
    if missing:
        raise ValueError(f"{what} lacks {len(missing)} parameter(s) of this {config.architecture}: {shown(missing)} (name "
                         "them through the mapping if they are spelled otherwise)")  # fmt: skip
    out = sorted(given)

    def place(*values):
        raw = loaded_values(layout, entries, dict(enumerate(values)))
        return [raw[i] for i in out]

    shardings = [sharding(layout.paths[i], tuple(layout.avals[i].shape)) for i in out]
    placed = jax.jit(place, out_shardings=shardings)(*inputs)
    leaves = list(abstract)
    for i, value in zip(out, placed):
        leaves[i] = value
    nnx.update(model, jax.tree_util.tree_unflatten(layout.treedef, leaves))
    jax.block_until_ready(placed)
    return given


class WeightUpdater:
    """A runner's weight updates: validation, the jitted re-layout per set of names, the swap."""

    def __init__(self, runner):
        self.runner = runner
        self.layout: LoadedLayout = runner.loaded_layout
        self._programs: dict[tuple, tuple] = {}
        self.missing: set[int] = set()  # loaded-layout parameters holding no real weights (sleep level 2)

    # -- what the runner's layout depends on ---------------------------------------------------------

    def _laid_out(self, raw_leaves: list) -> tuple[Any, list]:
        """(treedef, leaves) of the runner's state made from loaded-layout leaves, as start-up made it (traced)."""
        from jaxpaged.models.sharding import replicate_kv_heads

        model = nnx.merge(self.layout.graphdef, jax.tree_util.tree_unflatten(self.layout.treedef, raw_leaves))
        self.runner.prepare_weights(model)
        _, state = nnx.split(model)
        if self.runner.mesh is not None:
            state, _ = replicate_kv_heads(state, self.layout.config, self.runner.tp)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        return treedef, leaves

    @functools.cached_property
    def _dependencies(self) -> tuple[list[frozenset[int]], list[int | None]]:
        """Per leaf of the runner's state: the loaded-layout leaves it is computed from, and the one it is as it is
        (None if it is computed). Read off the traced layout program; checked against the runner's state."""
        from jax.extend.core import Literal

        out_tree = []

        def leaves(raw):
            treedef, out = self._laid_out(list(raw))
            out_tree.append(treedef)
            return out

        closed = jax.make_jaxpr(leaves)(list(self.layout.avals))
        target_leaves, target_tree = jax.tree_util.tree_flatten(self.runner.state)
        got = [(tuple(v.aval.shape), v.aval.dtype) for v in closed.jaxpr.outvars]
        want = [(tuple(x.shape), x.dtype) for x in target_leaves]
        if out_tree[0] != target_tree or got != want:  # a layout step that does not replay: a bug, not bad input
            raise RuntimeError("update_weights: re-laying the loaded weights out does not give the runner's parameters "
                               "(its platform's prepare_model does not trace); this engine cannot update weights")  # fmt: skip
        jaxpr = closed.jaxpr
        deps: dict[Any, frozenset[int]] = {v: frozenset([i]) for i, v in enumerate(jaxpr.invars)}
        for eqn in jaxpr.eqns:
            d = frozenset().union(*(deps.get(v, frozenset()) for v in eqn.invars if not isinstance(v, Literal)))
            for o in eqn.outvars:
                deps[o] = d
        inputs = {v: i for i, v in enumerate(jaxpr.invars)}
        out_deps = [frozenset() if isinstance(v, Literal) else deps.get(v, frozenset()) for v in jaxpr.outvars]
        identity = [None if isinstance(v, Literal) else inputs.get(v) for v in jaxpr.outvars]
        return out_deps, identity

    # -- checking what was given ---------------------------------------------------------------------

    # -- the update ------------------------------------------------------------------------------------

    def update(self, weights, mapping: Mapping_ = None, copy: bool = False) -> dict[str, Any]:
        """Replace the runner's parameters the given tensors make; -> what it did (counts, seconds)."""
        return self.apply(self.plan(weights, mapping, copy))

    def plan(self, weights, mapping: Mapping_ = None, copy: bool = False) -> _Plan:
        """Check an update (names, shapes, dtypes, what the layout needs together) without changing anything.
        copy: the engine keeps none of the given arrays (no pointer swap), for a caller that donates them later."""
        t0 = time.perf_counter()
        entries, inputs, given = resolve(self.layout, named_arrays(weights, mapping))
        out_deps, _ = self._dependencies
        touched = [o for o, d in enumerate(out_deps) if d & given]
        lacking = {i for o in touched for i in out_deps[o] - given}
        if lacking:
            why = " (fuse_projections: a layer's q/k/v, and its gate/up, are one weight)" if self.runner.config.fuse_projections else ""
            raise ValueError(f"update_weights: this engine lays these parameters out together with others{why}, so they "
                             "must come with them; also give " + shown(sorted(self.layout.paths[i] for i in lacking)))  # fmt: skip
        return _Plan(entries, inputs, given, touched, t0, copy)

    def apply(self, plan: _Plan) -> dict[str, Any]:
        """Run a checked update and swap its parameters in."""
        entries, inputs, given, touched, t0 = plan.entries, plan.inputs, plan.given, plan.touched, plan.started
        out_deps, identity = self._dependencies
        target_leaves, target_tree = jax.tree_util.tree_flatten(self.runner.state)
        inputs = [self._on_devices(x, target_leaves, identity, entry) for x, entry in zip(inputs, entries)]
        # pointer swaps: a laid-out leaf that is a loaded one as it is, given in its dtype on its sharding
        swapped = {}
        by_target = {e.targets[0]: (e, inputs[e.given]) for e in entries if len(e.targets) == 1}
        for o in touched if not plan.copy else ():
            entry, x = by_target.get(identity[o], (None, None))
            if entry is not None and entry.fn is None and not entry.transpose and entry.split is None and entry.ops == ("keep",) and \
                    x.sharding.is_equivalent_to(target_leaves[o].sharding, x.ndim):  # fmt: skip
                swapped[o] = x
        computed = [o for o in touched if o not in swapped]
        new_leaves = list(target_leaves)
        if computed:
            needed = frozenset().union(*(out_deps[o] for o in computed))
            used = [e.given for e in entries if needed & set(e.targets)]
            program = self._program(entries, used, computed, [inputs[k] for k in used], target_leaves)
            for o, value in zip(computed, program(*[inputs[k] for k in used])):
                new_leaves[o] = value
        for o, x in swapped.items():
            new_leaves[o] = x
        # the swap: one assignment, after everything above succeeded
        self.runner.state = jax.tree_util.tree_unflatten(target_tree, new_leaves)
        self.missing -= given
        seconds = time.perf_counter() - t0
        logger.info("update_weights: %d tensors -> %d parameters (%d computed, %d taken as given) in %.3fs", len(entries),
                    len(touched), len(computed), len(swapped), seconds)  # fmt: skip
        return {"tensors": len(entries), "parameters": len(touched), "computed": len(computed), "swapped": len(swapped),
                "seconds": seconds}  # fmt: skip

    def _on_devices(self, x, target_leaves, identity, entry: _Entry):
        """A given array on the runner's devices: moved device to device where it is elsewhere (or from the host where
        it is a numpy array), left as it is where it already is on them (no transfer)."""
        runner = self.runner
        devices = {runner.device} if runner.mesh is None else set(runner.mesh.devices.flat)
        if isinstance(x, jax.Array) and set(x.sharding.device_set) == devices:
            return x  # the program reshards it if it must
        if runner.mesh is None:
            return jax.device_put(x, runner.device)
        from jax.sharding import NamedSharding, PartitionSpec

        target = None
        if entry.fn is None and not entry.transpose and entry.split is None and len(entry.targets) == 1:
            outs = [o for o, i in enumerate(identity) if i == entry.targets[0]]
            target = target_leaves[outs[0]].sharding if outs else None
        return jax.device_put(x, target or NamedSharding(runner.mesh, PartitionSpec()))

    def _program(self, entries: list[_Entry], used: list[int], computed: list[int], args: list, target_leaves):
        """The compiled layout program for this set of names and input shapes (compiled on first use, then kept)."""
        key = (tuple(entries), tuple(used), tuple(computed),
               tuple((x.shape, x.dtype, x.sharding) for x in args))  # fmt: skip
        compiled = self._programs.get(key)
        if compiled is not None:
            return compiled
        layout = self.layout

        def program(*values):
            raw = loaded_values(layout, entries, dict(zip(used, values)))
            raw = [jnp.zeros(a.shape, a.dtype) if v is None else v for v, a in zip(raw, layout.avals)]  # unused: dropped
            leaves = self._laid_out(raw)[1]
            return [leaves[o] for o in computed]

        jitted = jax.jit(program, out_shardings=[target_leaves[o].sharding for o in computed])
        with compile_monitor.expected(), self.runner._on_mesh():
            compiled = jitted.lower(*args).compile()
        self._programs[key] = compiled
        return compiled


def safetensors_weights(path: str | Path, layout: LoadedLayout) -> dict[str, jax.Array]:
    """A folder of safetensors (or one file), tensors only, by HF name, on the default device (a MoE's per-expert
    tensors stacked as the loader stacks them)."""
    tensors = _safetensors(path, layout)
    return {name: jax.device_put(np.require(array, requirements=("C", "W"))) for name, array in tensors}


def safetensors_shapes(path: str | Path, layout: LoadedLayout) -> dict[str, jax.ShapeDtypeStruct]:
    """safetensors_weights' shapes and dtypes, nothing copied to the devices: what checking an update needs."""
    return {name: jax.ShapeDtypeStruct(array.shape, array.dtype) for name, array in _safetensors(path, layout)}


def _safetensors(path: str | Path, layout: LoadedLayout) -> Iterable[tuple[str, np.ndarray]]:
    """(HF name, the host's memory-mapped view) for each tensor of a folder or file, regrouped as the loader does."""
    from jaxpaged.models import safetensors_io
    from jaxpaged.models.loader import _safetensors_files

    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"update_weights: {path} does not exist (pass a folder of safetensors or a .safetensors file)")
    files = _safetensors_files(path) if path.is_dir() else [path]
    if any(f.suffix != ".safetensors" for f in files):
        raise ValueError(f"update_weights: {path} is not a .safetensors file")
    tensors: Iterable = safetensors_io.tensors_in_order(safetensors_io.open_files(files))
    regroup = getattr(layout.port, "regroup_tensors", None)
    if regroup is not None:  # the port's own regrouping reads its config only
        tensors = regroup(types.SimpleNamespace(config=layout.config), tensors)
    return ((name, array) for name, array, _ in tensors)
