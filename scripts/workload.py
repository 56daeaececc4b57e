"""The benchmarks' shared random workloads and timing: one copy of each draw, so two scripts that claim the same
workload really run the same requests.

Each draw is kept bit for bit as the scripts first drew it: the figures in docs/benchmarks.md and docs/data/ were
measured on these exact token ids and lengths, and a changed draw would make a rerun incomparable with them.
Text and image workloads (bench_serving, bench_spec_decode, bench_vision, bench_rl_rollout) stay in their scripts:
each is its own kind of request, used once.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Self

Request = tuple[list[int], int]  # (prompt token ids, output length)


def uniform_requests(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                     seed: int = 0) -> list[Request]:  # fmt: skip
    """bench_throughput's and bench_quantization's draw (numpy): every prompt length, then every output length,
    uniform over the inclusive ranges, then each prompt's ids; ids avoid 10 at both ends of the vocabulary, where
    special tokens live."""
    import numpy as np

    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, num_requests)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    return [(rng.integers(10, vocab_size - 10, int(i)).tolist(), int(o)) for i, o in zip(in_lens, out_lens)]


def nano_vllm_requests(vocab: int, num_requests: int, lo: int, hi: int, seed: int = 0) -> list[Request]:
    """nano-vllm's benchmark draw (Python's random.Random), which gpu_report runs so its figures compare with
    nano-vllm's: per request its prompt length, its ids with randrange(10, vocab - 10), then its output length, each
    length uniform over [lo, hi] (256 requests over 100-1024: 139,291 output tokens)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = [rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))]
        requests.append((prompt, rng.randint(lo, hi)))
    return requests


def random_prompts(num: int, length: int, low: int, high: int, seed) -> list[list[int]]:
    """`num` prompts of `length` ids uniform over [low, high) (numpy). `seed` may be a numpy Generator, to go on
    drawing from one already in use (gpu_report's mla stage draws its batches from one)."""
    import numpy as np

    rng = np.random.default_rng(seed)  # a Generator passed in is returned as it is
    return [rng.integers(low, high, length).tolist() for _ in range(num)]


class Stopwatch:
    """Wall seconds (time.perf_counter) and this process's CPU seconds (time.process_time) since it started. As a
    context manager it restarts on entry and stops at the block's end, so its figures are the block's own."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.cpu_start = time.process_time()
        self.start = time.perf_counter()  # read last (and first at the stop): the wall time holds no clock reads
        self.stopped: tuple[float, float] | None = None

    def __enter__(self) -> Self:
        self.restart()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped = (time.perf_counter(), time.process_time())

    @property
    def seconds(self) -> float:
        return (self.stopped[0] if self.stopped else time.perf_counter()) - self.start

    @property
    def cpu_seconds(self) -> float:
        return (self.stopped[1] if self.stopped else time.process_time()) - self.cpu_start


def median_seconds(fn, *args, iters: int, warmup: int = 1) -> float:
    """The median wall time of fn(*args) over `iters` calls, each waited for on the device, after `warmup` untimed
    calls (the compile and first-use costs stay out of it; the median keeps one slow call out too)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        with Stopwatch() as clock:
            jax.block_until_ready(fn(*args))
        times.append(clock.seconds)
    return statistics.median(times)
