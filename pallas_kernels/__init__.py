"""Paged attention over the KV-block array: the entry point, its metadata, the backends behind one interface (the
Pallas kernels and the pure-JAX reference; the native CPU kernel lives with the CPU platform)."""

from jaxpaged.pallas_kernels.attention import copy_blocks, paged_attention, stack_new_kv, write_kv
from jaxpaged.pallas_kernels.backends import AttentionBackend, MosaicAttention, ReferenceAttention, TritonAttention
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, AttentionSpec, kv_cache_shape

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "MosaicAttention",
    "ReferenceAttention",
    "TritonAttention",
    "copy_blocks",
    "kv_cache_shape",
    "paged_attention",
    "stack_new_kv",
    "write_kv",
]
