"""The baseline vLLM's tutorials compare against: FastAPI around `transformers` generate, one request at a time.

A lock serialises generation (a transformers model serves one request at a time unless batched by
hand), so concurrent clients queue, first come first served, on one worker thread. It speaks just enough of OpenAI's completions and chat APIs
for `scripts/bench_serving.py`, streaming included (a TextIteratorStreamer per request). The
built-in SmolLM2 GGUF is loaded through transformers' own `gguf_file` support, as
tests/models/test_smollm2.py builds its reference.

    python scripts/hf_server.py --port 8001               # the built-in SmolLM2-135M-Instruct
    python scripts/hf_server.py --model ./some-hf-folder  # or an HF folder (safetensors)
"""


import argparse
import asyncio
import json
import os
import queue
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's `models` (the built-in path)


def load(model: str | None, dtype: str):
    import torch
    import transformers
    from jaxpaged.models.builtin import builtin_gguf_path

    path = Path(builtin_gguf_path() if model is None else model).expanduser()
    kwargs = {"dtype": getattr(torch, dtype)}
    if path.suffix == ".gguf":
        folder, kwargs["gguf_file"] = str(path.parent), path.name
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    else:
        folder = str(path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    hf_model.eval()
    torch.set_num_threads(os.cpu_count() or 1)
    return hf_model, tokenizer


def build_app(hf_model, tokenizer, served_name: str):
    import torch
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import TextStreamer

    app = FastAPI()
    jobs: queue.Queue = queue.Queue()
    lock = threading.Lock()  # one generate at a time

    class ToLoop(TextStreamer):
        """Hands each decoded piece to the request's asyncio queue (no thread blocks per waiting request)."""

        def __init__(self, loop, out: asyncio.Queue):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.loop, self.out = loop, out

        def on_finalized_text(self, text: str, stream_end: bool = False):
            if text:
                self.loop.call_soon_threadsafe(self.out.put_nowait, text)

    def worker():  # requests are served first come, first served, one at a time
        while True:
            kwargs, loop, out = jobs.get()
            try:
                with lock, torch.inference_mode():
                    new = hf_model.generate(**kwargs)[0, kwargs["input_ids"].shape[1] :].tolist()
                loop.call_soon_threadsafe(out.put_nowait, new)
            except Exception as exc:  # noqa: BLE001 - the request gets the error, the server goes on
                loop.call_soon_threadsafe(out.put_nowait, exc)

    threading.Thread(target=worker, daemon=True).start()

    def prompt_ids(body: dict, chat: bool) -> list[int]:
        if chat:
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)

    def generate_kwargs(body: dict, ids: list[int], streamer) -> dict:
        max_new = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        temperature = float(body["temperature"]) if body.get("temperature") is not None else 1.0
        kwargs = {
            "input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "max_new_tokens": max_new, "do_sample": temperature > 0, "streamer": streamer,
            "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        }
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=float(body.get("top_p") or 1.0))
        if body.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_new
        return kwargs

    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(meta: dict, chat: bool, text: str | None, finish: str | None) -> str:
        delta = ({"delta": {"content": text} if text else {}}) if chat else {"text": text or ""}
        return f"data: {json.dumps({**meta, 'choices': [{'index': 0, **delta, 'finish_reason': finish}]})}\n\n"

    async def serve(request: Request, chat: bool):
        body = await request.json()
        ids = prompt_ids(body, chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        meta = {"id": rid, "created": int(time.time()), "model": served_name,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        out: asyncio.Queue = asyncio.Queue()
        stream = bool(body.get("stream"))
        streamer = ToLoop(asyncio.get_running_loop(), out) if stream else None
        jobs.put((generate_kwargs(body, ids, streamer), asyncio.get_running_loop(), out))
        if not stream:
            new = await out.get()
            if isinstance(new, Exception):
                return JSONResponse({"error": {"message": str(new), "type": "server_error", "param": None, "code": None}}, 500)
            text = tokenizer.decode(new, skip_special_tokens=True)
            choice = {"index": 0, "finish_reason": "length", "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion",
                                 "choices": [choice], "usage": usage(len(ids), len(new))})

        async def events():
            while True:
                item = await out.get()
                if isinstance(item, str):
                    yield chunk(meta, chat, item, None)
                    continue
                if isinstance(item, Exception):
                    yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'server_error'}})}\n\n"
                else:
                    yield chunk(meta, chat, None, "length")
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield f"data: {json.dumps({**meta, 'choices': [], 'usage': usage(len(ids), len(item))})}\n\n"
                yield "data: [DONE]\n\n"
                return

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "transformers"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: the built-in SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--served-model-name", default=None, help="name reported and expected (default: the model's file name)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    args = p.parse_args(argv)
    import uvicorn
    from jaxpaged.models.builtin import BUILTIN_MODEL_NAME

    hf_model, tokenizer = load(args.model, args.dtype)
    name = args.served_model_name or (BUILTIN_MODEL_NAME if args.model is None else Path(args.model).name)
    uvicorn.run(build_app(hf_model, tokenizer, name), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
