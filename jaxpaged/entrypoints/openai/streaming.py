"""The engine requests behind one HTTP request: their updates, abort on disconnect, and SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.requests import Request

from jaxpaged.engine.async_engine import AsyncLLMEngine, RequestStream
from jaxpaged.outputs import RequestOutput


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class RequestRun:
    """Reads every stream of one HTTP request; a client that goes away has all of them aborted at once.

    Uvicorn answers `receive()` with `http.disconnect` when the connection drops, for streamed and
    plain responses alike, so a watcher task notices a vanished client even while no token is due.
    """

    def __init__(self, engine: AsyncLLMEngine, streams: list[RequestStream], http_request: Request):
        self.engine = engine
        self.streams = streams
        self.event = streams[0].event
        self.http_request = http_request
        self.disconnected = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.prompt_token_ids) for s in self.streams)

    def abort(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def _watch(self) -> None:
        while True:
            message = await self.http_request.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                self.abort()
                self.event.set()
                return

    async def updates(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Batches of (stream index, latest cumulative output); EngineDeadError if the loop dies."""
        watcher = asyncio.create_task(self._watch())
        try:
            while not self.disconnected:
                batch = [(i, out) for i, s in enumerate(self.streams) if (out := s.take()) is not None]
                if batch:
                    yield batch
                if all(s.finished and not s.pending for s in self.streams):
                    return
                self.event.clear()
                if not any(s.pending for s in self.streams):
                    await self.event.wait()
        finally:
            watcher.cancel()
            self.abort()

    async def final(self) -> list[RequestOutput]:
        """Wait for every stream to finish; the last output of each."""
        last: list[RequestOutput | None] = [None] * len(self.streams)
        async for batch in self.updates():
            for i, out in batch:
                last[i] = out
        return last  # type: ignore[return-value]


class Deltas:
    """What each choice has been sent so far, to turn cumulative outputs into stream deltas."""

    def __init__(self, count: int):
        self.text = [0] * count
        self.tokens = [0] * count
        self.started = [False] * count
        self.offsets = [0] * count  # completions' text_offset of the next token

    def advance(self, index: int, text: str, num_tokens: int) -> tuple[str, int, int]:
        """(new text, first new token, end of new tokens) for choice `index`, and mark them sent."""
        new_text = text[self.text[index] :]
        start = self.tokens[index]
        self.text[index], self.tokens[index] = len(text), num_tokens
        return new_text, start, num_tokens
