"""An Orbax checkpoint on a 2-way tensor-parallel engine (issue 47 step 3): each leaf restored as shards straight onto
the mesh (a column-parallel kernel's devices each read half of it), greedy tokens those of transformers."""

from __future__ import annotations

import jax
import pytest
from jaxpaged import LLM

from tests.hf_reference import hf_greedy
from tests.models.test_orbax import ENGINE, MAX_TOKENS, PROMPTS, _save, _tokens, port_state  # noqa: F401 (a fixture)
from tests.multi_device import needs_devices, rerun_with_devices

ocp = pytest.importorskip("orbax.checkpoint")


def test_with_devices():
    rerun_with_devices(__file__)


@needs_devices
def test_tensor_parallel_restore_puts_shards_on_their_devices(model_dir, hf_model, port_state, tmp_path):
    _save(tmp_path / "ckpt", port_state)
    restored = []
    real = ocp.PyTreeCheckpointer.restore

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        restored.extend(jax.tree_util.tree_leaves(out))
        return out

    ocp.PyTreeCheckpointer.restore = spy
    try:
        llm = LLM(str(tmp_path / "ckpt"), hf_config=model_dir, tensor_parallel_size=2, dtype="float32", **ENGINE)
    finally:
        ocp.PyTreeCheckpointer.restore = real
    kernels = [x for x in restored if x.ndim == 2 and x.shape[1] == 128]  # gate/up: column-parallel
    assert kernels and all(len(x.sharding.device_set) == 2 and x.addressable_shards[0].data.shape == (64, 64) for x in kernels)
    assert _tokens(llm) == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
