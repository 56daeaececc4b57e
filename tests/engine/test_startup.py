"""Start-up: compiled steps stored and loaded as executables, buckets compiled on first use, a quiet CLI."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import numpy as np
from jaxpaged.config import EngineConfig
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.utils import compile_monitor
from tests import REPO

# buckets 4, 8 and 16: several (one compiled on first use leaves others unused), each step of this file's engines
# compiled 8 programs (a 32-token bucket more made it 10 in each of some twenty engine starts)
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64, block_size=8,
              dtype="float32")
# one bucket (4 programs): for the tests where the compiled steps' count does not matter
ONE_BUCKET = dict(max_num_seqs=1, max_num_batched_tokens=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

    config = tiny_llama_config(num_key_value_heads=2)
    return save_hf_model(random_hf_model(config), tmp_path_factory.mktemp("startup-model"))


def _engine(model: Path, cache: Path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), cache_dir=str(cache), **{**ENGINE, **overrides}))


def _greedy(engine: LLMEngine, prompts) -> list[list[int]]:
    ids = [engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
           for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


_rng = np.random.default_rng(4)  # tests.hf_reference.random_prompts(256, (3, 9, 30), seed=4), without its torch import
PROMPTS = [_rng.integers(2, 256, size=n).tolist() for n in (3, 9, 30)]


def _in_new_process(model: Path, cache: Path) -> dict:
    """A fresh interpreter's engine on `cache`: what it loaded, compiled and generated. (This module imports no
    torch or transformers' models at its top, so that the interpreter does not either: ~4 s of CPU a start.)"""
    script = (
        "import json, sys; from pathlib import Path; from tests.engine.test_startup import _engine, _greedy, PROMPTS; "
        "e = _engine(Path(sys.argv[1]), Path(sys.argv[2])); x = e.runner.executables; "
        "print('RESULT', json.dumps({'loaded': x.num_loaded, 'compiled': x.num_compiled, 'tokens': _greedy(e, PROMPTS)}))"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(model), str(cache)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> LLMEngine:
    """A precompiled engine of ENGINE's shape, built once: the tokens and compiled steps the tests' engines (compiled
    on first use, in the background, side by side) must reproduce. Read only: its `tokens` are PROMPTS' greedy
    tokens, computed here."""
    engine = _engine(model_dir, tmp_path_factory.mktemp("reference"))
    engine.tokens = _greedy(engine, PROMPTS)
    assert engine.get_stats()["num_compiles_after_warmup"] == 0
    return engine


def _step_entries(root) -> list:
    """The runner's stored executables under `root`, not the loader's weight programs (`weight_*`, models/weights.py)."""
    return sorted(p for p in root.rglob("*.exe") if not p.name.startswith("weight_"))


def test_a_second_start_loads_every_executable_and_compiles_nothing(model_dir, tmp_path):
    first = _in_new_process(model_dir, tmp_path)  # a process of its own: the first compile of each program in it
    stored = _step_entries(tmp_path / "executables")
    runner = _engine(model_dir, tmp_path / "buckets", precompile=False).runner
    rows = {runner.bucket_for(t)[1] for t in runner.buckets}  # buckets with as many sampling rows share a sampler
    count = 2 * len(runner.buckets) + len(rows) + 1  # forward and write per bucket, sample per row count; copy
    assert first["compiled"] == count and len(stored) == count

    assert _in_new_process(model_dir, tmp_path) == {"loaded": count, "compiled": 0, "tokens": first["tokens"]}
    lowered = compile_monitor.compile_count()
    here = _engine(model_dir, tmp_path)
    assert here.runner.executables.num_loaded == count and here.runner.executables.num_compiled == 0
    assert compile_monitor.compile_count() - lowered < count  # no step was traced again (an eager op or two may be)
    assert _greedy(here, PROMPTS) == first["tokens"]
    assert here.get_stats()["num_compiles_after_warmup"] == 0


def test_a_program_compiled_twice_in_a_process_is_stored_once(model_dir, tmp_path):
    """XLA:CPU's second compile of a program in one process serializes into an executable that fails elsewhere
    ("Function ... not found"): only the first compile is stored, and what was stored runs in a new process."""
    want = _greedy(_engine(model_dir, tmp_path / "one"), PROMPTS)
    again = _engine(model_dir, tmp_path / "two")  # the same programs, compiled again here
    assert again.runner.executables.num_compiled > 0 and not _step_entries(tmp_path / "two")
    assert _greedy(again, PROMPTS) == want
    assert _in_new_process(model_dir, tmp_path / "one")["tokens"] == want


def test_a_damaged_entry_is_compiled_again_and_rewritten(model_dir, tmp_path, caplog):
    want = _in_new_process(model_dir, tmp_path)["tokens"]
    entries = _step_entries(tmp_path / "executables")
    for entry in entries:
        entry.write_bytes(b"not an executable")
    again = _engine(model_dir, tmp_path)
    assert again.runner.executables.num_loaded == 0 and again.runner.executables.num_compiled == len(entries)
    assert sum("could not load the cached executable" in r.getMessage() for r in caplog.records) == len(entries)
    assert _greedy(again, PROMPTS) == want
    assert _in_new_process(model_dir, tmp_path)["tokens"] == want  # the first start to compile them rewrites them
    assert _in_new_process(model_dir, tmp_path) == {"loaded": len(entries), "compiled": 0, "tokens": want}


def test_another_model_graph_never_takes_these_executables(model_dir, tmp_path, monkeypatch):
    from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

    monkeypatch.setattr("jaxpaged.worker.executable_cache._programs_seen", set())  # as in a new process: all stored
    _engine(model_dir, tmp_path, **ONE_BUCKET)
    assert _step_entries(tmp_path)  # executables the other model could take
    other = save_hf_model(random_hf_model(tiny_llama_config(num_key_value_heads=2, rope_theta=500.0)), tmp_path / "other")
    engine = _engine(other, tmp_path, **ONE_BUCKET)  # same shapes, one static attribute (the RoPE frequencies) differs
    assert engine.runner.executables.num_loaded == 0


def test_without_precompile_buckets_compile_on_first_use_and_results_are_the_same(model_dir, tmp_path, reference):
    eager = _engine(model_dir, tmp_path / "a", precompile=False)
    assert eager.warmup_seconds == 0.0 and not eager.runner._compiled
    got = _greedy(eager, PROMPTS)
    used = {bucket for _, bucket in eager.runner._compiled}
    assert 0 < len(used) < len(eager.runner.buckets)  # only what these steps needed
    assert eager.get_stats()["num_compiles_after_warmup"] == 0  # compiles on first use are the ones asked for
    assert got == reference.tokens


def test_a_bucket_compiled_in_the_background_is_picked_up(model_dir, tmp_path, reference):
    engine = _engine(model_dir, tmp_path / "a", precompile=False)
    smallest = engine.runner.buckets[0]
    engine.runner.prefetch(smallest)
    assert smallest in engine.runner._pending
    got = _greedy(engine, PROMPTS)
    assert not engine.runner._pending and ("write", smallest) in engine.runner._compiled
    assert engine.get_stats()["num_compiles_after_warmup"] == 0  # the background compile was asked for
    assert got == reference.tokens


def test_warmup_on_many_cores_compiles_the_buckets_side_by_side_once_each(model_dir, tmp_path, monkeypatch, reference):
    """With 4+ cores warm-up compiles on a thread pool: the same executables as one at a time (each sampler once),
    stored from the main thread, nothing after warm-up, the same tokens."""
    serial = reference  # compiled one at a time (2 cores in CI), in a folder of its own
    threads = []
    monkeypatch.setattr("jaxpaged.worker.bucket_compiles.os.cpu_count", lambda: 8)
    real_compile = serial.runner.executables.compile.__func__

    def compile_on(self, name, jitted, args, **kw):
        threads.append(__import__("threading").current_thread().name)
        return real_compile(self, name, jitted, args, **kw)

    monkeypatch.setattr(type(serial.runner.executables), "compile", compile_on)
    real_store, stored = serial.runner.executables._store.__func__, []

    def store_on(self, *args):
        stored.append(__import__("threading").current_thread().name)
        return real_store(self, *args)

    monkeypatch.setattr(type(serial.runner.executables), "_store", store_on)
    monkeypatch.setattr("jaxpaged.worker.executable_cache._programs_seen", set())  # as in a new process: all stored
    side_by_side = _engine(model_dir, tmp_path / "b")
    assert side_by_side.runner.executables.num_compiled == serial.runner.executables.num_compiled
    assert sorted(side_by_side.runner._compiled) == sorted(serial.runner._compiled)
    assert sum(name.startswith("jaxpaged-compile") for name in threads) == len(threads) - 1  # all but the block copy
    assert len(set(threads)) > 2  # several compile threads
    assert stored and set(stored) == {"MainThread"}  # serialized after warm-up's steps, never on a compile thread
    got = _greedy(side_by_side, PROMPTS)
    assert side_by_side.get_stats()["num_compiles_after_warmup"] == 0
    assert got == serial.tokens


def test_background_compile_serves_at_once_and_no_step_waits_for_a_compile(model_dir, tmp_path, monkeypatch, reference):
    """background_compile (a GPU's default): warm-up compiles only the largest bucket; the rest compile on a thread
    while steps run padded to the smallest bucket ready. Here those compiles are held until generation is over, so a
    step that waited for one would hang: the same tokens come out, nothing compiles after warm-up, and once the
    held compiles finish the small buckets are used."""
    import threading

    from jaxpaged.worker.executable_cache import ExecutableCache

    release, forwards = threading.Event(), []
    real_compile = ExecutableCache.compile

    def held_compile(self, name, jitted, args, **kw):
        if threading.current_thread().name.startswith("jaxpaged-compile") and name == "forward":
            forwards.append(name)
            if len(forwards) > 1:  # one compile thread: the first is the largest bucket's, which warm-up waits for
                assert release.wait(timeout=300), "a held compile was never released"
        return real_compile(self, name, jitted, args, **kw)

    monkeypatch.setattr(ExecutableCache, "compile", held_compile)
    monkeypatch.setattr("jaxpaged.worker.bucket_compiles.os.cpu_count", lambda: 2)  # one compile thread
    engine = _engine(model_dir, tmp_path / "a", background_compile=True)
    runner = engine.runner
    largest = runner.buckets[-1]
    assert runner.ready_buckets == [largest] and runner._pending  # served from the largest bucket alone
    assert ("forward", largest) in runner._compiled and ("forward", runner.buckets[0]) not in runner._compiled
    try:
        got = _greedy(engine, PROMPTS)
        assert runner.ready_buckets == [largest]  # every step ran in the largest bucket: none waited
        assert engine.get_stats()["num_compiles_after_warmup"] == 0
    finally:
        release.set()
    assert not reference.config.background_compile
    assert got == reference.tokens
    assert runner.finish_background_compiles() > 0
    assert runner.ready_buckets == runner.buckets and runner.step_bucket(1)[0] == runner.buckets[0]
    assert sorted(runner._compiled) == sorted(reference.runner._compiled)
    assert _greedy(engine, PROMPTS) == got  # now in the small buckets
    assert engine.get_stats()["num_compiles_after_warmup"] == 0


def test_background_compile_defaults_to_the_platforms_choice():
    from jaxpaged import platforms

    assert EngineConfig(**ENGINE).background_compile is False  # CPU: a step's bucket never depends on timing
    assert platforms.get("gpu").background_compile is True
    assert EngineConfig(**ENGINE, background_compile=True).background_compile is True


def test_precompiled_engines_still_count_a_compile_after_warmup(model_dir, tmp_path):
    """The guard still bites where precompile is on: a lowering during step() is counted."""
    import jax
    import jax.numpy as jnp

    engine = _engine(model_dir, tmp_path, **ONE_BUCKET)
    assert engine.runner._compiled  # precompiled
    step = engine._step

    def step_and_compile():
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7))
        return step()

    engine._step = step_and_compile
    _greedy(engine, PROMPTS[:1])
    assert engine.get_stats()["num_compiles_after_warmup"] > 0


def test_cli_defaults_to_compiling_on_first_use_with_one_sequence(model_dir, tmp_path, monkeypatch):
    from jaxpaged.entrypoints import generate

    args = generate.build_parser().parse_args(["hello"])
    assert args.precompile is False and args.max_num_seqs is None
    from jaxpaged.entrypoints.serve import build_parser as serve_parser

    assert serve_parser().parse_args([]).precompile is True
    captured = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            captured.update(kwargs)
            raise ValueError("stop here")

    monkeypatch.setattr("jaxpaged.entrypoints.llm.LLM", FakeLLM)
    assert generate.main(["hello", "--model", str(model_dir)]) == 2
    assert captured["max_num_seqs"] == 1 and captured["precompile"] is False
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    assert generate.main(["--prompts-file", str(prompts), "--precompile", "--model", str(model_dir)]) == 2
    assert captured["max_num_seqs"] is None and captured["precompile"] is True


def test_libraries_notices_are_hidden_unless_verbose(capsys):
    from jaxpaged.utils.logging_utils import setup_logging

    notice = logging.getLogger("transformers")
    handler = logging.StreamHandler(sys.stdout)
    notice.addHandler(handler)
    try:
        setup_logging("INFO")
        notice.warning("PyTorch was not found. Models won't be available.")
        notice.warning("a warning that matters")
        out = capsys.readouterr().out
        assert "PyTorch was not found" not in out and "a warning that matters" in out
        setup_logging("DEBUG")
        notice.warning("PyTorch was not found. Models won't be available.")
        assert "PyTorch was not found" in capsys.readouterr().out
    finally:
        notice.removeHandler(handler)
        setup_logging("INFO")


def test_bench_startup_phases_add_up():
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_startup import phases, startup_line

    line = ('12:00:00 DEBUG jaxpaged.generate: startup {"load_s": 1.0, "pack_s": 0.1, "kv_cache_s": 0.2, '
            '"warmup_s": 0.0, "compile_s": 0.5, "engine_start": 101.5, "first_text": 104.0}')
    got = phases(100.0, 104.0, startup_line("noise\n" + line + "\n"))
    assert got == pytest.approx({"import": 1.5, "load": 1.0, "pack": 0.1, "kv_cache": 0.2, "compile": 0.5, "other": 0.7})
    assert phases(100.0, None, None) == {}


def test_an_entry_this_process_already_holds_is_not_deserialized_again(tmp_path, monkeypatch):
    """A second engine on the same cache in one process takes the executables the first one compiled or loaded:
    deserializing a program this process already holds made XLA:CPU crash once (a CI run)."""
    from jaxpaged.worker import executable_cache

    # an MLP width no other test uses: forward programs this process has not compiled yet, so the first engine stores
    # them (programs it compiled before, as other tests' samplers, it does not store: see the test above)
    from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

    model_dir = save_hf_model(random_hf_model(tiny_llama_config(num_key_value_heads=2, intermediate_size=192)), tmp_path / "m")
    first = _engine(model_dir, tmp_path)
    stored = len(_step_entries(tmp_path))
    assert stored > 0
    want = _greedy(first, PROMPTS)

    def refuse(*args, **kwargs):
        raise AssertionError("deserialized a program this process already holds")

    monkeypatch.setattr(executable_cache.serialize_executable, "deserialize_and_load", refuse)
    second = _engine(model_dir, tmp_path)
    assert second.runner.executables.num_loaded == stored  # every stored entry, none of them deserialized
    assert second.runner.executables.num_compiled == first.runner.executables.num_compiled - stored
    assert _greedy(second, PROMPTS) == want
