"""One benchmark request over HTTP, streamed (SSE) as any OpenAI client would read it.

Times are seconds since the start of the run (time.perf_counter based). A content chunk is
one output token almost always; a token that ends inside a UTF-8 character, or a special
token, sends no chunk of its own, so token counts come from the final `usage`.
"""

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import aiohttp

from services.bench.workloads import BenchRequest

CancelMode = Literal["disconnect", "delete"]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    index: int
    prompt_tokens: int  # from usage when the server sent it, else as drawn
    max_tokens: int
    sent_at: float
    request_id: str = ""
    first_token_at: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    finished_at: float | None = None
    output_tokens: int = 0  # usage.completion_tokens; chunks counted when the stream was cut
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False  # the bench cancelled it on purpose
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens found in the prefix cache
    conversation: int = -1  # multiturn: its conversation and turn
    turn: int = 0
    text: str = ""  # what it answered (multiturn sends it back in the next turn; not in reports)
    executor: str = ""  # what served it, as the gateway's x-iterserve-executor header said ("emulated": no model)

    @property
    def ok(self) -> bool:
        """Completed normally: it counts in throughput and latency."""
        return self.error is None and not self.cancelled and self.finish_reason in ("stop", "length")

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (decode speed as this request saw it)."""
        if self.first_token_at is None or self.finished_at is None or self.output_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]

    def to_json(self) -> dict:
        record = asdict(self)
        del record["text"]
        # Every time to the microsecond alike: rounding keeps their order (a chunk rounded alone
        # could land after a finish read a fraction of a microsecond later).
        for key in ("sent_at", "first_token_at", "finished_at"):
            if record[key] is not None:
                record[key] = round(record[key], 6)
        record["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return record


def _now(run_start: float) -> float:
    return time.perf_counter() - run_start


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    request: BenchRequest,
    model: str,
    temperature: float,
    run_start: float,
    *,
    cancel_after_chunks: int | None = None,
    cancel_mode: CancelMode = "disconnect",
    timeout_s: float = 600.0,
) -> RequestResult:
    """Send one request and read its stream to the end (or cancel it after some chunks)."""
    result = RequestResult(request.index, request.prompt_tokens, request.max_tokens, _now(run_start),
                           conversation=request.conversation, turn=request.turn)
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(session, base_url, request, model, temperature, run_start, result,
                          cancel_after_chunks, cancel_mode)
    except TimeoutError:
        result.error = f"no answer within {timeout_s:.0f}s"
    except aiohttp.ClientError as error:
        result.error = f"{type(error).__name__}: {error}"
    if result.finished_at is None:
        result.finished_at = _now(run_start)
    return result


async def _stream(session, base_url, request, model, temperature, run_start, result, cancel_after, cancel_mode) -> None:
    url = base_url.rstrip("/") + PATHS[request.endpoint]
    async with session.post(url, json=request.body(model, temperature)) as response:
        result.executor = response.headers.get("x-iterserve-executor", "")
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
            return
        async for raw_line in response.content:
            line = raw_line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators and keep-alive comments
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = str(chunk["error"].get("message", chunk["error"]))
                break
            result.request_id = chunk.get("id", result.request_id)
            for choice in chunk.get("choices") or ():
                text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if text:
                    result.text += text
                    now = _now(run_start)
                    if result.first_token_at is None:
                        result.first_token_at = now
                    result.chunk_times.append(now)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
                    result.finished_at = _now(run_start)
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
                result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if cancel_after is not None and result.finish_reason is None and len(result.chunk_times) >= cancel_after:
                result.cancelled = True
                result.output_tokens = len(result.chunk_times)
                result.finished_at = _now(run_start)
                if cancel_mode == "disconnect":
                    response.close()  # the gateway sees the connection go and cancels the request
                    return
                cancel_after = None
                await _delete(session, base_url, result.request_id)  # then read on to the final chunk
        if result.finish_reason is None and result.error is None and not result.cancelled:
            result.error = "stream ended without a finish_reason"
        if result.output_tokens == 0:
            result.output_tokens = len(result.chunk_times)


async def _delete(session: aiohttp.ClientSession, base_url: str, request_id: str) -> None:
    async with session.delete(f"{base_url.rstrip('/')}/v1/requests/{request_id}") as response:
        await response.read()
