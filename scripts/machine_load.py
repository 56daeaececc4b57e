"""Was the machine quiet while a benchmark side ran? Load average and other processes' CPU, per side.

The benchmark scripts share a machine with other jobs, and contention slows the systems unequally
(transformers far more than jaxpaged), so each side records the
1-minute load average before and after it and the CPU time that processes outside this benchmark's
own process tree used while it ran, and is flagged busy when either says someone else was working:

- load before > BUSY_LOAD_PER_CORE x cores (1.0 on 2 cores), after waiting up to --settle-s for it
  to drop (the previous side's own load takes a minute or two to decay), or
- other processes used more than BUSY_OTHERS_SHARE of the machine's CPU time during the side, or
- the hypervisor gave more than BUSY_STEAL_SHARE of it to other guests (steal time, /proc/stat): a
  shared VM's neighbours show up only there, not in its load average.

The load after a side is mostly the side itself, so it is recorded, not judged.
"""

from __future__ import annotations

import os
import threading
import time

BUSY_LOAD_PER_CORE = 0.5
BUSY_OTHERS_SHARE = 0.10
BUSY_STEAL_SHARE = 0.05
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def load1() -> float:
    return os.getloadavg()[0]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_model() -> str:
    """'AMD EPYC (family 25, model 1, AVX2)' from /proc/cpuinfo: the hosts behind one VM name differ ('' if unknown)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return ""
    flags = fields.get("flags", "").split()
    simd = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), "")
    detail = [f"family {fields['cpu family']}" if "cpu family" in fields else "", f"model {fields['model']}" if "model" in fields else "", simd]
    detail = ", ".join(d for d in detail if d)
    return fields.get("model name", "") + (f" ({detail})" if detail else "")


def busy_reason(before: float | None, others_share: float | None, n_cores: int, steal_share: float | None = None) -> str:
    """Why a side counts as run on a busy machine ('' when it was quiet); the rule in the module docstring."""
    reasons = []
    if before is not None and before > BUSY_LOAD_PER_CORE * n_cores:
        reasons.append(f"1-min load {before:.2f} before it (> {BUSY_LOAD_PER_CORE * n_cores:.1f} on {n_cores} cores)")
    if others_share is not None and others_share > BUSY_OTHERS_SHARE:
        reasons.append(f"other processes used {100 * others_share:.0f}% of the CPU during it (> {100 * BUSY_OTHERS_SHARE:.0f}%)")
    if steal_share is not None and steal_share > BUSY_STEAL_SHARE:
        reasons.append(f"{100 * steal_share:.0f}% of the CPU time was stolen by other guests (> {100 * BUSY_STEAL_SHARE:.0f}%)")
    return "; ".join(reasons)


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, all) ticks since boot from /proc/stat's cpu line; None where there is none."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (values[7] if len(values) > 7 else 0), sum(values[:8])  # guest time is already inside user


def settle(max_wait_s: float, n_cores: int, poll_s: float = 5.0, log=print) -> float:
    """Wait (at most max_wait_s) for the 1-min load to drop to the busy threshold; returns the seconds waited."""
    limit, t0 = BUSY_LOAD_PER_CORE * n_cores, time.monotonic()
    while load1() > limit and time.monotonic() - t0 < max_wait_s:
        if time.monotonic() - t0 < poll_s:
            log(f"waiting up to {max_wait_s:.0f}s for the 1-min load ({load1():.2f}) to drop to {limit:.1f}")
        time.sleep(poll_s)
    return time.monotonic() - t0


def proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks used so far) for every process we can read (Linux /proc)."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces and ')'
        except (OSError, IndexError):
            continue  # gone meanwhile
        table[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    return table


def descendants(table: dict[int, tuple[int, int]], root: int) -> set[int]:
    """root and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    ours, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in ours:
            ours.add(pid)
            todo.extend(children.get(pid, []))
    return ours


def others_ticks(prev: dict[int, tuple[int, int]], now: dict[int, tuple[int, int]], ours: set[int]) -> int:
    """CPU ticks that processes outside `ours` used between two tables; a new pid counts whole."""
    total = 0
    for pid, (_, ticks) in now.items():
        if pid not in ours:
            before = prev.get(pid)
            total += ticks - before[1] if before else ticks
    return total


class SideWatch:
    """Around one benchmark side: load before/after, other processes' CPU share (sampled every poll_s)."""

    def __init__(self, name: str, poll_s: float = 2.0, judge_before: bool = True):
        """judge_before=False: the load before is the previous run's own (a sweep's later points), not a verdict."""
        self.name, self.poll_s, self.n_cores, self.judge_before = name, poll_s, cores(), judge_before
        self._stop = threading.Event()
        self._ticks = 0

    def _sample(self) -> None:
        now = proc_table()
        self._ticks += others_ticks(self._prev, now, descendants(now, os.getpid()))
        self._prev = now

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._sample()

    def __enter__(self):
        self.before, self._t0, self._cpu0 = load1(), time.monotonic(), cpu_ticks()
        self._prev = proc_table()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
        cpu0, cpu1 = self._cpu0, cpu_ticks()
        steal = (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]) if cpu0 and cpu1 else None
        wall = time.monotonic() - self._t0
        self.record = side_record(self.before, load1(), self._ticks / _TICKS, wall, self.n_cores, steal, self.judge_before)


def side_record(before: float, after: float, others_cpu_s: float, wall_s: float, n_cores: int,
                steal: tuple[int, int] | None = None, judge_before: bool = True) -> dict:  # fmt: skip
    """One side's load figures for the JSON, with the busy verdict and its reason; steal is (stolen, all) ticks."""
    share = others_cpu_s / (wall_s * n_cores) if wall_s > 0 else None
    steal_share = steal[0] / steal[1] if steal and steal[1] > 0 else None
    reason = busy_reason(before if judge_before else None, share, n_cores, steal_share)
    return {"loadavg_1min": {"before": before, "after": after}, "others_cpu_s": others_cpu_s, "wall_s": wall_s,
            "others_cpu_share": share, "steal_ticks": list(steal) if steal else None, "steal_share": steal_share,
            "cores": n_cores, "busy": bool(reason), "busy_reason": reason}


def merge_records(records: list[dict]) -> dict:
    """One side made of several watched runs (a serving sweep): first before, last after, CPU and steal summed."""
    steals = [r.get("steal_ticks") for r in records]
    steal = (sum(s[0] for s in steals), sum(s[1] for s in steals)) if all(steals) else None
    return side_record(records[0]["loadavg_1min"]["before"], records[-1]["loadavg_1min"]["after"],
                       sum(r["others_cpu_s"] for r in records), sum(r["wall_s"] for r in records), records[0]["cores"], steal)  # fmt: skip


def busy_lines(sides: dict[str, dict]) -> list[str]:
    """The warnings a script prints at the end, one per busy side."""
    return [f"WARNING: {name} ran on a busy machine: {rec['busy_reason']}" for name, rec in sides.items() if rec.get("busy")]
