"""The model's generation_config.json as the default sampling parameters (vLLM's generation_config "auto"): for
LLM.generate without SamplingParams and the server's fields left unset; "vllm" and overrides."""

from __future__ import annotations

import json

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.generation_defaults import check_generation_config, default_sampling_kwargs
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

QWEN3_STYLE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 5,
               "repetition_penalty": 1.0, "bos_token_id": 0}  # fmt: skip


def _folder(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_fields_vllm_reads_and_transformers_defaults_left_out(tmp_path):
    folder = _folder(tmp_path, QWEN3_STYLE)
    # repetition_penalty 1.0 is transformers' default, not a choice; do_sample and the ids are not sampling fields
    assert default_sampling_kwargs("auto", {}, str(folder)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5}
    assert default_sampling_kwargs("auto", {}, str(folder / "config.json")) == default_sampling_kwargs("auto", {}, str(folder))
    assert default_sampling_kwargs("vllm", {}, str(folder)) == {}
    assert default_sampling_kwargs("vllm", {"temperature": 1.0}, str(folder)) == {"temperature": 1.0}  # said, so kept
    assert default_sampling_kwargs("auto", {"top_k": 5}, str(folder))["top_k"] == 5
    assert default_sampling_kwargs("auto", {}, str(tmp_path / "model.gguf")) == {}
    assert default_sampling_kwargs(str(folder), {}, None)["temperature"] == 0.6  # a folder named instead


def test_bad_settings_name_the_option(tmp_path):
    with pytest.raises(ValueError, match="generation_config"):
        check_generation_config(str(tmp_path), None)  # no generation_config.json there
    with pytest.raises(ValueError, match="unknown"):
        check_generation_config("auto", {"temprature": 0.5})
    with pytest.raises(ValueError, match="JSON"):
        check_generation_config("auto", "{temperature: 0.5}")
    assert check_generation_config("auto", '{"temperature": 0.5}') == {"temperature": 0.5}


def test_llm_generate_without_params_takes_the_models_defaults(model_dir, tmp_path):
    import shutil

    folder = shutil.copytree(model_dir, tmp_path / "m")
    _folder(folder, QWEN3_STYLE)
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=32, log_level="WARNING")
    llm = LLM(str(folder), **kwargs)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.95, 20, 5)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5  # max_new_tokens, where SamplingParams() would give 16
    greedy = LLM(str(folder), override_generation_config={"temperature": 0.0}, **kwargs)
    assert greedy.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids == llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    plain = LLM(str(folder), generation_config="vllm", **kwargs)
    assert plain.get_default_sampling_params().temperature == 1.0
    assert len(plain.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_server_fields_left_unset_take_the_models_defaults():
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 5}
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    params = chat.sampling_params(defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 5)
    said = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.9, max_tokens=50)
    params = said.sampling_params(defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.9, 20, 5)  # max_new_tokens caps, as vLLM's
    completion = CompletionRequest(model="m", prompt="hi")
    assert completion.sampling_params(defaults=defaults).max_tokens == 5  # under OpenAI's 16
    assert completion.sampling_params().temperature == 1.0  # no defaults: SamplingParams'
