"""LoRARequest as vLLM's: its positional order, and equality and hashing by lora_name alone."""

from __future__ import annotations

import pytest

from jaxpaged import LoRARequest


def test_vllm_positional_order():
    r = LoRARequest("sql", 3, "path/to/sql", "base-model")
    assert (r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name) == ("sql", 3, "path/to/sql", "base-model")
    assert (r.name, r.adapter_id, r.path) == ("sql", 3, "path/to/sql")


def test_equal_and_hashed_by_name_alone():
    a, same_name = LoRARequest("sql", 1, "one/path"), LoRARequest("sql", 2, "another/path", "base")
    assert a == same_name and hash(a) == hash(same_name) and len({a, same_name}) == 1
    assert {a: "x"}[same_name] == "x"
    assert a != LoRARequest("chat", 1, "one/path") and a != "sql"


def test_fields_are_still_checked_and_frozen():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "somewhere")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("x", 1)
    with pytest.raises(AttributeError):
        LoRARequest("x", 1, "p").lora_path = "q"
    assert LoRARequest("x", 7, "p").cache_salt == b"lora:7:p"  # the prefix cache still keys on the id and path
