"""Scheduling and KV-block bookkeeping on the host: requests, the block pool, the KV cache manager, the scheduler (pure Python, no JAX)."""
