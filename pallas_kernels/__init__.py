"""Paged attention over the KV-block array (the public entry point, its metadata and its reference) and the
native CPU kernels."""

from jaxpaged.pallas_kernels import cpu_attention, cpu_matmul
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
    "cpu_attention",
    "cpu_matmul",
    "kv_cache_shape",
    "kv_storage_dtype",
    "paged_attention",
    "resolve_attention_backend",
    "stack_new_kv",
    "write_kv",
]
