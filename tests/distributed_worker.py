"""One process of a test's process group: `python -m tests.distributed_worker SPEC.json PROCESS_ID`.

Every process builds the same LLM (a local checkpoint, TP over the group's devices); process 0 generates greedily
for the spec's prompts and writes {"tokens": [...]} (or {"error": ...}) to spec["out"]; the others follow it.
With spec["forever"], process 0 keeps generating until something fails (the kill test)."""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str, process_id: int) -> int:
    spec = json.loads(open(spec_path).read())
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={spec['local_devices']}"
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.distributed import ProcessGroupError

    # 8-token steps (buckets 4 and 8): the test's longer prompts still prefill in chunks
    llm = LLM(spec["model"], dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8,
              attention_backend="reference", tensor_parallel_size=spec["tensor_parallel_size"], log_level="WARNING",
              coordinator_address=spec["coordinator"], num_processes=spec["num_processes"], process_id=process_id,
              distributed_timeout_s=spec.get("timeout", 60))  # fmt: skip
    if llm.is_follower:
        return 0  # process 0 released it
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    result: dict = {}
    try:
        while True:
            outs = llm.generate(prompts, params, use_tqdm=False)
            result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            result["compiles_after_warmup"] = llm.get_stats()["num_compiles_after_warmup"]
            if not spec.get("forever"):
                break
            with open(spec["out"] + ".progress", "w") as f:
                f.write("generating")
    except ProcessGroupError as e:
        result["error"] = str(e)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
