"""Paged attention over the KV-block array: the public entry point, its metadata, the Pallas kernels and the pure-JAX
reference (the native CPU kernels live with the CPU platform, jaxpaged/platforms/cpu/)."""

from jaxpaged.pallas_kernels.attention import (
    ATTENTION_BACKENDS,
    copy_blocks,
    kv_storage_dtype,
    paged_attention,
    resolve_attention_backend,
    stack_new_kv,
    write_kv,
)
from jaxpaged.pallas_kernels.metadata import AttentionMetadata, kv_cache_shape

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "copy_blocks",
    "kv_cache_shape",
    "kv_storage_dtype",
    "paged_attention",
    "resolve_attention_backend",
    "stack_new_kv",
    "write_kv",
]
