"""bench_throughput.py --structured: its schema, run order, step bookkeeping and output checks, vllm_runner's choice
of vLLM's structured-outputs API, and the jaxpaged side end to end on the tiny cycle model (vLLM's side runs against
a stand-in in tests/test_bench_baselines.py)."""

from __future__ import annotations

import json
import sys
import types

import jsonschema
import pytest

from tests import REPO
from tests.structured_cases import SMALL_SCHEMA

sys.path.insert(0, str(REPO / "scripts"))

import bench_throughput  # noqa: E402
import provenance  # noqa: E402
import throughput_structured  # noqa: E402
import vllm_runner  # noqa: E402


def test_builtin_schema_cannot_end_before_the_longest_output():
    from jaxpaged.engine.structured_output import StructuredOutputManager
    from jaxpaged.sampling_params import StructuredOutputsParams
    from tests.cycle_model import EOS_ID, VOCAB, _tokenizer

    schema = throughput_structured.builtin_schema(2)
    assert schema["properties"]["records"]["minItems"] == 2
    manager = StructuredOutputManager(_tokenizer(), [EOS_ID], VOCAB)  # byte-level: one token per byte
    state = manager.new_state(StructuredOutputsParams(json=schema))
    for byte in b'{"records":[{"name":"a","score":1}':
        assert state.accept(byte)
    refused = manager.new_state(StructuredOutputsParams(json=schema))
    for byte in b'{"records":[{"name":"a","score":1}':
        refused.accept(byte)
    assert not refused.accept(ord("]"))  # one record is too few
    for byte in b',{"name":"","score":2}]}':
        assert state.accept(byte)
    assert state.is_terminated
    jsonschema.validate({"records": [{"name": "a", "score": 1}, {"name": "", "score": 2}]}, schema)


def test_order_alternates_so_drift_falls_on_both_modes():
    assert throughput_structured.structured_order(1) == ["free", "json"]
    assert throughput_structured.structured_order(3) == ["free", "json", "json", "free", "free", "json"]


def test_arguments():
    args = bench_throughput.parse_args(["--structured"])
    assert args.structured and args.schema is None and args.structured_repeats == 2
    for bad in (["--schema", "s.json"], ["--structured", "--output-lens", "8,16"], ["--structured", "--structured-repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_throughput.parse_args(bad)


def test_outputs_are_checked_when_the_grammar_ended_them():
    outputs = [('{"name":"ab","ok":true,"color":"red"}', "stop"), ('{"name":"a', "length"),
               ('{"name":"toolong","ok":true,"color":"red"}', "stop"), ('{"name":', "stop")]  # fmt: skip
    checked = throughput_structured.check_outputs(outputs, SMALL_SCHEMA)
    assert checked["finish"] == {"stop": 3, "length": 1} and checked["checked"] == 3
    assert checked["valid"] == 1 and checked["invalid"] == 2
    assert checked["errors"][0].startswith("output 2: ValidationError") and checked["errors"][1].startswith("output 3: JSONDecodeError")
    assert checked["texts"] == [list(o) for o in outputs]


def _step(seconds, *scheduled, fill_s=0.0, fill_rows=0):
    return {"scheduled": list(scheduled), "seconds": seconds, "fill_s": fill_s, "fill_rows": fill_rows, "accept_s": 0.0}


def test_decode_steps_keep_calls_that_touched_only_one_batch_size_of_pure_decode():
    steps = [
        _step(9.0, (2, 40)),  # a prefill
        _step(8.0, (2, 2)),  # finishes the prefill step (scheduled in the call before): out
        _step(1.0, (2, 2)),
        _step(1.2, (2, 2), (2, 2)),  # an overlapped call that scheduled twice
        _step(7.0, (3, 20)),  # a prompt chunk joins
        _step(6.0, (3, 3)),
        _step(1.5, (3, 3)),
        _step(0.5),  # nothing scheduled: only the previous call's step read
        _step(0.1),
    ]
    assert throughput_structured.decode_steps(steps) == {2: [1.0, 1.2], 3: [1.5, 0.5]}


def test_step_comparison_prefers_the_full_batch():
    free = {4: [1.0, 1.0, 1.0], 3: [0.8] * 5}
    constrained = {4: [1.05, 1.08, 1.2], 3: [0.8] * 5, 2: [0.1] * 9}
    fill = {4: {"fill_ms": 0.4, "fill_us_per_row": 100.0, "accept_ms": 0.1}}
    cmp = throughput_structured.step_comparison(free, constrained, 4, fill)
    assert cmp["rows"] == 4 and cmp["full_batch"] and cmp["overhead_pct"] == pytest.approx(8.0)
    assert cmp["overhead_pct_all_batch_sizes"] == pytest.approx(100 * (3 * 1.08 + 5 * 0.8) / (3 * 1.0 + 5 * 0.8) - 100)
    assert cmp["mask_fill_us_per_row"] == 100.0 and cmp["by_rows"]["2"]["free"] == {"steps": 0}
    fallback = throughput_structured.step_comparison(free, constrained, 64, fill)
    assert fallback["rows"] == 4 and not fallback["full_batch"]
    assert throughput_structured.structured_goal({"steps": cmp})["passed"] is None  # not batch 64
    goal = throughput_structured.structured_goal({"steps": cmp | {"rows": 64}})
    assert goal == {"rows": 64, "max_overhead_pct": 10.0, "overhead_pct": cmp["overhead_pct"], "passed": True}
    assert throughput_structured.step_comparison(free, {2: [0.1] * 9}, 4, {})["rows"] is None


@pytest.mark.parametrize("api", ["structured_outputs", "guided_decoding"])
def test_runner_uses_the_api_its_vllm_has(api, monkeypatch):
    """vLLM >= 0.11 has StructuredOutputsParams and SamplingParams(structured_outputs=...); older ones GuidedDecodingParams."""
    vllm = types.ModuleType("vllm")
    sampling = types.ModuleType("vllm.sampling_params")

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class Constraint:
        def __init__(self, json):
            self.json = json

    vllm.SamplingParams = SamplingParams
    setattr(sampling, "StructuredOutputsParams" if api == "structured_outputs" else "GuidedDecodingParams", Constraint)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    name, make = vllm_runner.json_params({"type": "object"})
    params = make(max_tokens=3, ignore_eos=True)
    assert name == api and params.kw[api].json == {"type": "object"} and params.kw["max_tokens"] == 3


def test_structured_mode_end_to_end_on_the_cycle_model(tmp_path, monkeypatch, capsys):
    """jaxpaged free and under a schema its grammar ends well before max_tokens: every constrained output validates,
    the tokens each mode generated are reported, and the steps of both modes are compared at the full batch."""
    from tests.cycle_model import write_cycle_model

    folder = write_cycle_model(tmp_path / "model")
    schema_file, out = tmp_path / "schema.json", tmp_path / "out.json"
    schema_file.write_text(json.dumps(SMALL_SCHEMA))
    monkeypatch.setattr(provenance, "calibrate", lambda: {"f32_matmul_gflops_jax": 1.0})
    argv = ["--num-requests", "6", "--input-len-range", "8", "24", "--output-len-range", "64", "80"]
    bench_throughput.main(["--model", str(folder), "--structured", "--schema", str(schema_file), *argv, "--max-num-seqs", "4",
                           "--max-num-batched-tokens", "32", "--structured-repeats", "1", "--settle-s", "0", "--json", str(out)])  # fmt: skip
    workload = bench_throughput.make_workload(bench_throughput.parse_args(argv), 264)
    report = json.loads(out.read_text())
    section = report["structured"]
    assert section["schema"] == SMALL_SCHEMA and section["schema_source"] == str(schema_file) and section["order"] == ["free", "json"]
    jp = section["jaxpaged"]
    assert [r["mode"] for r in jp["runs"]] == ["free", "json"]
    assert jp["free"]["output_tokens"] == sum(o for _, o in workload)
    assert 0 < jp["json"]["output_tokens"] < jp["free"]["output_tokens"]  # the grammar ended every output early
    outputs = jp["outputs"]
    assert outputs["finish"] == {"stop": 6} and outputs["valid"] == 6 and outputs["invalid"] == 0
    for text, reason in outputs["texts"]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SMALL_SCHEMA)
    steps = jp["steps"]
    assert steps["rows"] == 4 and steps["full_batch"] and steps["free"]["steps"] >= 3 and steps["json"]["steps"] >= 3
    assert steps["cpu"]["free"]["steps"] == steps["free"]["steps"] and isinstance(steps["cpu"]["overhead_pct"], float)
    assert steps["mask_fill_us_per_row"] > 0 and steps["mask_fill_ms_per_step"] > 0 and steps["accept_ms_per_step"] > 0
    assert isinstance(steps["overhead_pct"], float) and isinstance(jp["overhead_pct_per_token"], float)
    assert jp["num_compiles_during_runs"] == 0 and report["jaxpaged"]["enable_prefix_caching"] is False
    assert all({"loadavg_1min", "others_cpu_share"} <= set(r["load"]) for r in jp["runs"])
    assert section["goal"]["passed"] is None  # batch 4, not the goal's 64
    assert set(report["results"]) == {"jaxpaged", "jaxpaged json"} and set(report["load"]) == {"jaxpaged"}
    assert report["machine"]["llguidance"]
    printed = capsys.readouterr().out
    assert "-- structured outputs: schema " in printed and "of 6 ended by the grammar, 6 valid" in printed
