"""Images through jaxpaged against transformers on the same CPU and model, in one run (issue 46, step 5).

The model is a random Qwen2.5-VL of small real shapes (a SmolLM2-135M-sized language model, an 8-block window ViT),
written with its processor to a folder that both sides load, unless --model names one. The workload: --num-requests
requests with one image each (sizes drawn between --min-side and --max-side pixels, each a different image, each
prompt different before its image), greedy, --max-tokens tokens each with EOS ignored, so both sides do the same work.

- images/s through the encoder: every request's image alone, jaxpaged's compiled encoder (batched into its
  patch-count buckets as the engine does) against transformers' get_image_features in batches of --batch-size;
- end to end: jaxpaged's LLM.generate over all requests against transformers' generate in padded batches of
  --batch-size (the processor's own padding); output tokens per second and images per second;
- the encoder cache: the same prompts with one image repeated in all of them (each prompt's text differs before the
  image, so no KV block is shared and only the encoder cache can help), against distinct images;
- with --tensor-parallel-size N (on the CPU, N simulated devices): what one device holds of the vision tower (kept
  whole on every device) and of the language model (split), beside the same images/s and tok/s figures.

    python scripts/bench_vision.py --num-requests 64 --json docs/data/bench_vision_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Qwen2.5-VL (or other supported VLM) folder with its processor; default: a random one")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-side", type=int, default=112)
    p.add_argument("--max-side", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8, help="transformers' padded batch (and its encoder batch)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="a tiny model (tests)")
    p.add_argument("--skip-hf", action="store_true", help="jaxpaged only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="jaxpaged's (on the CPU: simulated devices)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def small_qwen2_5_vl(tiny: bool):
    """A Qwen2.5-VL config of small real shapes (the text model SmolLM2-135M's), or a tiny one."""
    import transformers

    from tests.vlm_models import QWEN_IDS, QWEN_VOCAB

    if tiny:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[1])
        text = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    else:
        vision = dict(depth=8, hidden_size=384, intermediate_size=1536, num_heads=6, out_hidden_size=576,
                      fullatt_block_indexes=[3, 7])  # fmt: skip
        text = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    vision |= dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, in_channels=3)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    sections = [head_dim // 8, (head_dim // 2 - head_dim // 8) // 2]
    sections.append(head_dim // 2 - sum(sections))
    text |= dict(vocab_size=QWEN_VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=None,
                 eos_token_id=QWEN_IDS["<|im_end|>"],
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections})  # fmt: skip
    return transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=QWEN_IDS["<|image_pad|>"], video_token_id=QWEN_IDS["<|video_pad|>"],
        vision_start_token_id=QWEN_IDS["<|vision_start|>"], vision_end_token_id=QWEN_IDS["<|vision_end|>"],
        eos_token_id=QWEN_IDS["<|im_end|>"],
    )  # fmt: skip


def write_model(folder: Path, args) -> Path:
    import transformers

    from tests.vlm_models import qwen_vl_processor, random_vlm, write_vlm

    config = small_qwen2_5_vl(args.tiny)
    model = random_vlm(config, seed=args.seed, std=0.02)
    side = args.max_side
    image_processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": side * side}, patch_size=14, merge_size=2, temporal_patch_size=2)
    return write_vlm(folder, model, qwen_vl_processor(image_processor=image_processor))


def workload(args, repeat: bool = False):
    """(prompts as chat messages, their images): each prompt's text differs before its image."""
    from PIL import Image

    rng = np.random.default_rng(args.seed)
    pictures = []
    for i in range(args.num_requests):
        w, h = (int(x) for x in rng.integers(args.min_side, args.max_side + 1, size=2))
        pictures.append(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    if repeat:  # an image no other request holds, in every request
        pictures = [Image.fromarray(rng.integers(0, 256, (args.max_side, args.min_side, 3), dtype=np.uint8))] * len(pictures)
    messages = [[{"role": "user", "content": [{"type": "text", "text": f"Request {i}: look."}, {"type": "image", "image": p},
                                             {"type": "text", "text": "Describe it."}]}] for i, p in enumerate(pictures)]  # fmt: skip
    return messages, pictures


def run_jaxpaged(folder: Path, args) -> dict:
    import jax

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.utils.text import ChatPrompt

    t0 = time.perf_counter()
    llm = LLM(str(folder), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tensor_parallel_size, log_level="WARNING")  # fmt: skip
    startup = time.perf_counter() - t0
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out = {"startup_s": startup, "encoder_buckets": engine.runner.mm.buckets, "bytes_per_device": bytes_per_device(engine)}
    # the encoder alone: every image, batched into buckets as the engine batches a step's images
    messages, pictures = workload(args)
    processor = engine.mm.processor
    items = [processor.chat(m)[1].images[0] for m in messages]
    from jaxpaged.multimodal.encoder_cache import EncodeWork

    cache = engine.runner.mm.cache
    for repeat in range(2):  # (the first pass: any first-call costs)
        work = [EncodeWork(image.item, np.full(image.length, cache.num_rows, np.int32)) for image in items]  # rows dropped
        t0 = time.perf_counter()
        engine.runner.mm.encode(work)
        jax.block_until_ready(engine.runner.mm.array)
        encode_s = time.perf_counter() - t0
    out["encoder"] = {"images": len(items), "seconds": encode_s, "images_per_s": len(items) / encode_s,
                      "patches": int(sum(i.item.num_patches for i in items))}  # fmt: skip
    for name, repeat in (("distinct_images", False), ("one_image_repeated", True)):
        messages, _ = workload(args, repeat)
        before = llm.get_stats()
        t0 = time.perf_counter()
        outs = llm.generate([ChatPrompt(m) for m in messages], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = llm.get_stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[name] = {
            "seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds, "images_per_s": len(outs) / seconds,
            "images_encoded": after["encoder_images_encoded"] - before["encoder_images_encoded"],
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        }  # fmt: skip
        if name == "distinct_images":
            out["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    out["num_compiles_after_warmup"] = llm.get_stats()["num_compiles_after_warmup"]
    return out


def bytes_per_device(engine) -> dict:
    """What the first device holds of the vision tower and projector (models/sharding.py keeps them whole) and of
    the rest of the weights (split under tensor parallelism)."""
    from flax import nnx

    from jaxpaged.models.sharding import VISION_PREFIXES
    from jaxpaged.models.weights import param_bytes

    held = {"vision": 0, "language": 0, "model": param_bytes(engine.runner.state)}  # model: all devices' shards once
    for path, leaf in nnx.to_flat_state(engine.runner.state):
        name = ".".join(str(p) for p in path)
        held["vision" if name.startswith(VISION_PREFIXES) else "language"] += leaf.get_value().addressable_shards[0].data.nbytes
    return held


def run_transformers(folder: Path, args) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    from jaxpaged.models.vision.qwen_vl import images_only

    processor = images_only(transformers.Qwen2_5_VLProcessor).from_pretrained(str(folder))
    processor.tokenizer.padding_side = "left"
    messages, pictures = workload(args)
    b = args.batch_size
    out = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        for i in range(0, len(pictures), b):
            pv = processor.image_processor(images=pictures[i : i + b], return_tensors="pt")
            model.model.get_image_features(pv["pixel_values"], pv["image_grid_thw"])
        seconds = time.perf_counter() - t0
        out["encoder"] = {"images": len(pictures), "seconds": seconds, "images_per_s": len(pictures) / seconds}
        tokens, token_ids, t0 = 0, [], time.perf_counter()
        for i in range(0, len(messages), b):
            batch = processor.apply_chat_template(messages[i : i + b], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="pt", processor_kwargs={"padding": True})  # fmt: skip
            gen = model.generate(**batch, do_sample=False, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
            new = gen[:, batch["input_ids"].shape[1] :]
            tokens += new.numel()
            token_ids += new.tolist()
        seconds = time.perf_counter() - t0
    out["distinct_images"] = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
                              "images_per_s": len(messages) / seconds, "batch_size": b}  # fmt: skip
    out["token_ids"] = token_ids
    return out


def _side(run, folder, args) -> dict:
    """A side's results with the machine's 1-minute load before and after it (scripts/machine_load.py)."""
    import machine_load

    before = machine_load.load1()
    out = run(folder, args)
    out["load1"] = [before, machine_load.load1()]
    return out


def main(argv=None) -> dict:
    import machine_load

    args = parse_args(argv)
    if args.tensor_parallel_size > 1 and "jax" not in sys.modules:  # simulated CPU devices, set before JAX starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.tensor_parallel_size}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else write_model(Path(tmp) / "qwen2_5_vl", args)
        print(f"model: {folder}", file=sys.stderr)
        jp = _side(run_jaxpaged, folder, args)
        hf = None if args.skip_hf else _side(run_transformers, folder, args)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": machine_load.cpu_model() or platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "args": vars(args), "jaxpaged": {k: v for k, v in jp.items() if k != "token_ids"},
        "transformers": None if hf is None else {k: v for k, v in hf.items() if k != "token_ids"},
    }  # fmt: skip
    if hf is not None:
        same = sum(a == b for a, b in zip(jp["token_ids"], hf["token_ids"]))
        result["greedy_tokens_equal"] = f"{same}/{len(hf['token_ids'])}"
        result["ratios"] = {
            "encoder_images_per_s": jp["encoder"]["images_per_s"] / hf["encoder"]["images_per_s"],
            "output_tok_s": jp["distinct_images"]["output_tok_s"] / hf["distinct_images"]["output_tok_s"],
        }
    rep, dist = jp["one_image_repeated"], jp["distinct_images"]
    result["encoder_cache"] = {"images_encoded": [dist["images_encoded"], rep["images_encoded"]],
                               "speedup": dist["seconds"] / rep["seconds"]}  # fmt: skip
    print(f"{'':24}{'jaxpaged':>12}{'transformers':>14}")
    print(f"{'encoder images/s':24}{jp['encoder']['images_per_s']:12.2f}{(hf or {}).get('encoder', {}).get('images_per_s', float('nan')):14.2f}")
    print(f"{'end-to-end images/s':24}{dist['images_per_s']:12.2f}{(hf or {}).get('distinct_images', {}).get('images_per_s', float('nan')):14.2f}")
    print(f"{'output tok/s':24}{dist['output_tok_s']:12.1f}{(hf or {}).get('distinct_images', {}).get('output_tok_s', float('nan')):14.1f}")
    print(f"encoder cache: one image repeated {rep['seconds']:.2f}s ({rep['images_encoded']} encoded) against distinct "
          f"{dist['seconds']:.2f}s ({dist['images_encoded']} encoded): {result['encoder_cache']['speedup']:.2f}x")
    if hf is not None:
        print(f"greedy tokens equal: {result['greedy_tokens_equal']}")
    held = jp["bytes_per_device"]
    print(f"one device holds (tensor parallel {args.tensor_parallel_size}): vision tower {held['vision'] / 2**20:.1f} MiB, "
          f"language model {held['language'] / 2**20:.1f} MiB")
    for name, side in (("jaxpaged", jp), ("transformers", hf)):
        if side is not None and max(side["load1"]) > os.cpu_count():
            print(f"WARNING: the machine was busy during {name}'s run (1-minute load {side['load1']} on {os.cpu_count()} cores)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
