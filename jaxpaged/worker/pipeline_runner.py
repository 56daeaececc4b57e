"""Pipeline parallelism: the layers cut into P stages, each on its own devices with its slice of the KV cache.

Stage s holds layers [a_s, b_s) (and, on the first and last stage, the embeddings, final norm and head), on
tensor_parallel_size devices of its own (a "model" mesh when more than one), and a KV array of its layers only; block
ids mean the same in every stage, so the scheduler is unchanged. A step's rows are cut into micro-batches, one per
stage: each runs stage by stage, its activations moved to the next stage's devices by JAX, and its new K/V written
into the stage's cache before the next micro-batch reaches that stage. Dispatch is asynchronous and each stage runs
on its own devices, so stage s works on micro-batch m + 1 while stage s + 1 works on micro-batch m.

A sequence cut by a micro-batch boundary continues in the next one as a chunked prefill does: its earlier rows'
K/V are already in the stage's cache. So each micro-batch carries the attention metadata of a step of its own
(split_step), and every attention backend runs unchanged. The last stage joins the micro-batches' outputs for the
final norm, the logits and the sampler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.layers import Attention
from jaxpaged.models.loader import LoadedModel
from jaxpaged.models.weights import param_bytes
from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape
from jaxpaged.worker.input_batch import StepInputs
from jaxpaged.worker.kv_memory import kv_pool
from jaxpaged.worker.model_runner import ModelRunner, logits_and_prompt
from jaxpaged.worker.step_output import DispatchedStep


@dataclasses.dataclass
class MicroBatch:
    input_ids: np.ndarray  # [rows]
    positions: np.ndarray
    attention: AttentionMetadata  # of `seqs` slots
    prev_rows: np.ndarray


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layers [a, b) of each stage, as even as the count allows (earlier stages take one fewer)."""
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={stages} exceeds the model's {num_layers} layers")
    cuts = [s * num_layers // stages for s in range(stages + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def split_step(step: StepInputs, chunks: int, rows: int, seqs: int) -> list[MicroBatch]:
    """The step's rows cut into `chunks` runs of `rows`, each with the metadata of a step of its own: its sequences
    packed into slots 0.., and a sequence cut by a boundary continuing as a chunked prefill (seq_len ends at the
    chunk's last row; the rows before are cached by then)."""
    md = step.attention
    total = chunks * rows

    def pad(a, fill):
        out = np.full(total, fill, np.int32)
        if a is not None:
            out[: len(a)] = a
        return out

    ids, positions, slots = pad(step.input_ids, 0), pad(step.positions, 0), pad(md.slot_mapping, -1)
    prev_rows = pad(step.prev_rows, -1)
    starts, ends = md.query_start_loc[:-1], md.query_start_loc[1:]
    out = []
    for c in range(chunks):
        c0, c1 = c * rows, (c + 1) * rows
        lo, hi = np.clip(starts, c0, c1), np.clip(ends, c0, c1)
        live = np.nonzero(hi > lo)[0]
        k = len(live)
        tables = np.zeros((seqs, md.block_tables.shape[1]), np.int32)
        tables[:k] = md.block_tables[live]
        seq_lens = np.zeros(seqs, np.int32)
        seq_lens[:k] = md.seq_lens[live] - (ends[live] - hi[live])
        query_start_loc = np.zeros(seqs + 1, np.int32)
        query_start_loc[1 : k + 1] = np.cumsum(hi[live] - lo[live])
        query_start_loc[k + 1 :] = query_start_loc[k]
        rope_lens = None
        if md.rope_lens is not None:
            rope_lens = np.zeros(seqs, np.int32)
            rope_lens[:k] = md.rope_lens[live]
        attention = AttentionMetadata(slots[c0:c1], tables, seq_lens, query_start_loc, rope_lens)
        out.append(MicroBatch(ids[c0:c1], positions[c0:c1], attention, prev_rows[c0:c1]))
    return out


class PipelineRunner(ModelRunner):
    """ModelRunner over P stages; the engine, scheduler and sampler see no difference."""

    @staticmethod
    def _kv_groups(config, model_config) -> None:
        """No KV cache groups: a stage's cache holds its own layers (a hybrid model keeps every block, its window a
        mask)."""
        return None

    # -- placement ----------------------------------------------------------------------------

    def _place(self, loaded: LoadedModel) -> None:
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxpaged.models.sharding import check_divisible, make_mesh, replicate_kv_heads

        p, tp = self.config.pipeline_parallel_size, self.tp
        model, cfg = loaded.model, self.model_config
        if cfg.option("no_pipeline_parallel"):
            raise ValueError(f"pipeline_parallel_size={p}: {cfg.option('no_pipeline_parallel')}")
        self.bounds = stage_bounds(cfg.num_layers, p)
        self.stage_graphdefs = self._stage_graphdefs(model)
        self.graphdef, state = nnx.split(model)
        if tp > 1:
            check_divisible(cfg, tp)
            state, cfg = replicate_kv_heads(state, cfg, tp)
            self.model_config = cfg
        self.meshes = [make_mesh(tp, self.devices[s * tp : (s + 1) * tp]) if tp > 1 else None for s in range(p)]
        self.mesh = None  # the base class's one-mesh paths are not taken: every call names its stage
        # where each stage's activations (replicated over its mesh) and inputs live
        self.places = [NamedSharding(m, PartitionSpec()) if m is not None else self.devices[s * tp] for s, m in enumerate(self.meshes)]

        self._place_weights(state)
        self.state = self.stage_leaves  # what the memory plan counts
        del state
        self.num_blocks = self._pool_size(param_bytes(self.stage_leaves))
        self.kv_cache_dtype = self.config.kv_cache_dtype
        self.kv_cache, self._stages, self._writes, self._copies = [], [], [], []
        for s in range(p):
            self._place_stage(s)
        last = self.places[-1] if self.meshes[-1] is not None else None
        self._head = jax.jit(self._head_impl, out_shardings=None if last is None else (last, last))
        self._samplers = self._sampler_plans({"out_shardings": None if last is None else (last, last)})
        self._first_no_sampled = jax.device_put(np.zeros(self.config.max_num_seqs, np.int32), self.places[0])
        jax.block_until_ready(self.kv_cache)

    def _place_weights(self, state) -> None:
        """Each parameter onto the stage(s) that read it, split over the stage's mesh by its path under TP."""
        from jaxpaged.models.sharding import dotted_path, param_sharding

        p = len(self.bounds)
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.num_leaves = len(flat)
        self.owned: list[list[int]] = [[] for _ in range(p)]  # stage -> indices of its leaves in the flat state
        self.stage_leaves: list[list[jax.Array]] = [[] for _ in range(p)]
        for i, (keypath, leaf) in enumerate(flat):
            path = dotted_path(keypath)
            parts = path.split(".")
            if parts[0] == "layers":
                layer = int(parts[1])
                owners = [next(s for s, (a, b) in enumerate(self.bounds) if a <= layer < b)]
            else:  # embeddings, position tables, final norm, head: the first stage embeds, the last one reads out
                owners = sorted({0, p - 1})
            for s in owners:
                mesh = self.meshes[s]
                where = param_sharding(mesh, path, leaf.shape) if mesh is not None else self.places[s]
                self.owned[s].append(i)
                self.stage_leaves[s].append(jax.device_put(leaf, where))

    def _place_stage(self, s: int) -> None:
        """Stage s's KV array (its layers only) and its jitted forward, KV write and block copy."""
        from jaxpaged.models.sharding import new_kv_sharding

        (a, b), cfg, mesh = self.bounds[s], self.model_config, self.meshes[s]
        shape = kv_cache_shape(b - a, cfg.num_kv_heads, self.num_blocks, self.block_size, cfg.head_dim)
        cache, write, copy = kv_pool(shape, self.kv_cache_dtype, self.platform.kv_storage_dtype(self.dtype), mesh, self.places[s])
        self.kv_cache.append(cache)
        self._writes.append(write)
        self._copies.append(copy)
        stage = functools.partial(self._stage_impl, s)
        self._stages.append(jax.jit(stage) if mesh is None else jax.jit(stage, out_shardings=(self.places[s], new_kv_sharding(mesh))))

    def _stage_graphdefs(self, model) -> list:
        """Each stage's view of the model: its layers' attention reads layer i - a of the stage's own cache."""
        attention = [[m for _, m in nnx.iter_modules(layer) if isinstance(m, Attention)] for layer in model.layers]
        graphdefs = []
        for a, b in self.bounds:
            for i in range(a, b):
                for m in attention[i]:
                    m.layer = i - a
            graphdefs.append(nnx.graphdef(model))
        for i, modules in enumerate(attention):
            for m in modules:
                m.layer = i
        return graphdefs

    @property
    def single_device(self) -> bool:
        return False

    def memory_plan(self) -> str:
        p, tp = self.config.pipeline_parallel_size, self.tp
        layers = ", ".join(f"{b - a}" for a, b in self.bounds)
        return f"{super().memory_plan()}; {p} pipeline stages of {tp} device(s), layers per stage {layers}"

    def _put(self, array: np.ndarray) -> jax.Array:
        """Inputs kept on the device are the sampler's, on the last stage."""
        return jax.device_put(array, self.places[-1])

    def _on_mesh(self, stage: int = -1):
        mesh = self.meshes[stage]
        return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()

    # -- the step -----------------------------------------------------------------------------

    def _stage_model(self, s: int, leaves):
        full = [None] * self.num_leaves
        for i, leaf in zip(self.owned[s], leaves, strict=True):
            full[i] = leaf
        blank = jnp.zeros((0,), jnp.float32)  # another stage's weights: never read here
        return nnx.merge(self.stage_graphdefs[s], jax.tree_util.tree_unflatten(self.treedef, [blank if x is None else x for x in full]))

    def _stage_impl(self, s, leaves, kv_cache, x, positions, attn_metadata, prev_sampled, prev_rows):
        model = self._stage_model(s, leaves)
        if s == 0:  # x: token ids, those the previous step sampled taken from its device output
            ids = jnp.where(prev_rows >= 0, prev_sampled[jnp.maximum(prev_rows, 0)], x)
            x = model.embed(ids, positions)
        a, b = self.bounds[s]
        return model.run_layers(x, positions, kv_cache, attn_metadata, [model.layers[i] for i in range(a, b)])

    def _head_impl(self, leaves, parts, logit_rows, prompt_next_ids):
        model = self._stage_model(len(self.bounds) - 1, leaves)
        hidden = model.final(jnp.concatenate(parts)[: prompt_next_ids.shape[0]])
        return logits_and_prompt(model, hidden, logit_rows, prompt_next_ids)

    def micro_batches(self, num_tokens: int) -> tuple[int, int]:
        """(chunks, rows each) of a bucket: one chunk per stage, as far as the rows go."""
        chunks = min(len(self.bounds), num_tokens)
        return chunks, -(-num_tokens // chunks)

    def _forward_and_write(self, step: StepInputs, prev: DispatchedStep | None) -> tuple:
        t = step.input_ids.shape[0]
        chunks, rows = self.micro_batches(t)
        seqs = min(rows, self.config.max_num_seqs)
        prev_sampled = jax.device_put(prev.sampled, self.places[0]) if prev is not None else self._first_no_sampled
        outs = []
        for mb in split_step(step, chunks, rows, seqs):
            x = mb.input_ids
            for s in range(len(self.bounds)):
                if s > 0:
                    x = jax.device_put(x, self.places[s])  # the activations, to the next stage's devices
                first = s == 0
                args = (self.stage_leaves[s], self.kv_cache[s], x, mb.positions, mb.attention,
                        prev_sampled if first else None, mb.prev_rows if first else None)  # fmt: skip
                with self._on_mesh(s):
                    x, new_kv = self._executable(f"stage{s}", self._stages[s], rows, args)(*args)
                    args = (self.kv_cache[s], new_kv, mb.attention.slot_mapping)
                    self.kv_cache[s] = self._executable(f"write{s}", self._writes[s], rows, args)(*args)
            outs.append(x)
        next_ids = step.prompt_next_ids if step.prompt_next_ids is not None else self._all_minus_one(t)
        args = (self.stage_leaves[-1], tuple(outs), step.logit_rows, next_ids)
        with self._on_mesh():
            return self._executable("head", self._head, t, args)(*args)

    def _copy_batch_now(self, pairs: list[tuple[int, int]]) -> None:
        src, dst = self._copy_arrays(pairs)
        for s in range(len(self.bounds)):
            args = (self.kv_cache[s], src, dst)
            with self._on_mesh(s):
                self.kv_cache[s] = self._executable(f"copy{s}", self._copies[s], 0, args)(*args)
