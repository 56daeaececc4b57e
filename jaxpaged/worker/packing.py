"""A step's many small host arrays sent to the device as one int32 buffer, and taken apart inside the jitted step.

Each host-to-device copy has a fixed cost on the host (a staging buffer, a transfer call, an array object), and a
step has a dozen or more small inputs (token ids, positions, slots, block tables, offsets, a dozen sampling
knobs): one packed copy instead of one each keeps that off the step loop. The layout (every leaf's shape, dtype
and offset) is static, part of the pytree's structure, so each bucket's layout is compiled into its executable.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# what a leaf may be, stored as 32 bits (keyed by dtype: a dtype's .name is computed in Python, per call)
_KINDS = {np.dtype(np.int32): "i", np.dtype(np.uint32): "u", np.dtype(np.float32): "f", np.dtype(np.bool_): "b"}


@dataclasses.dataclass(frozen=True)
class Layout:
    treedef: Any  # the packed tree's structure
    shapes: tuple[tuple[int, ...], ...]
    kinds: str  # a letter per leaf: its dtype (_KINDS)
    offsets: tuple[int, ...]  # where each leaf starts in the buffer
    size: int


@functools.lru_cache(maxsize=256)
def _layout(treedef, shapes: tuple, kinds: str) -> Layout:
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)[:-1]])) if sizes else ()
    return Layout(treedef, shapes, kinds, offsets, int(sum(sizes)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """A tree of host arrays as one int32 buffer; `unpack()` inside jit gives the tree back."""

    data: Any  # [size] int32: numpy on the host, a device array once placed
    layout: Layout = dataclasses.field(metadata={"static": True})

    @classmethod
    def of(cls, tree) -> Packed:
        """Called twice a step (the forward's inputs, the sampler's): a few microseconds a leaf would add up."""
        return cls.of_leaves(*jax.tree_util.tree_flatten(tree))

    @classmethod
    def of_leaves(cls, leaves, treedef) -> Packed:
        """A flattened tree: leaves in treedef's order."""
        leaves = [leaf if type(leaf) is np.ndarray else np.asarray(leaf) for leaf in leaves]
        try:
            kinds = "".join([_KINDS[leaf.dtype] for leaf in leaves])
        except KeyError as exc:
            raise TypeError(f"cannot pack a {exc.args[0]} array: int32, uint32, float32 and bool only") from None
        layout = _layout(treedef, tuple([leaf.shape for leaf in leaves]), kinds)
        flat = [leaf.reshape(-1).astype(np.int32) if kind == "b" else leaf.reshape(-1).view(np.int32)
                for leaf, kind in zip(leaves, kinds)]  # fmt: skip
        return cls(np.concatenate(flat) if flat else np.empty(0, np.int32), layout)

    def unpack(self):
        """The tree, from slices of the buffer (inside jit: static slices and bitcasts, no copies to speak of)."""
        layout, out = self.layout, []
        for shape, kind, offset in zip(layout.shapes, layout.kinds, layout.offsets):
            size = int(np.prod(shape, dtype=np.int64))
            flat = jax.lax.slice_in_dim(self.data, offset, offset + size)
            if kind == "f":
                flat = jax.lax.bitcast_convert_type(flat, jnp.float32)
            elif kind == "u":
                flat = jax.lax.bitcast_convert_type(flat, jnp.uint32)
            elif kind == "b":
                flat = flat != 0
            out.append(flat.reshape(shape))
        return jax.tree_util.tree_unflatten(layout.treedef, out)
