"""/dashboard: a live page of the iteration schedule, and the feed it draws from.

The page (dashboard.html beside this file) is one static HTML file with plain JavaScript, no
build step. It polls /status (workers, their KV blocks, the queue) and follows
/dashboard/events, a server-sent-events feed of every served model's iteration records (the
recent ones first, then each as the schedulers write it) and, every second, this gateway's
time to first token and time per output token over the last minute. The page itself holds no
data and is served to anyone; the feed needs an API key whenever keys are configured, and the
page asks for one (or takes `#key=...` from its URL).
"""

import json
import time
from contextlib import aclosing
from pathlib import Path

from aiohttp import web

from services.gateway.state import STATE
from shared.messages import IterationRecord

PAGE = Path(__file__).with_name("dashboard.html")
BACKLOG = 200  # iteration records a new page gets first, per model
LATENCY_EVERY_SECONDS = 1.0


async def dashboard_page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE.read_text(), content_type="text/html", headers={"Cache-Control": "no-cache"})


def iteration_event(model: str, record: IterationRecord) -> bytes:
    body = record.model_dump(mode="json") | {"model": model}
    return b"event: iteration\ndata: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def dashboard_events(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    streams = {model.keys.iterations: model.name for model in state.models.values()}
    next_latency = 0.0
    try:
        async with aclosing(state.store.follow_iterations(streams, BACKLOG)) as feed:
            async for records in feed:
                if records:
                    await response.write(b"".join(iteration_event(model, record) for model, record in records))
                if time.monotonic() >= next_latency:
                    next_latency = time.monotonic() + LATENCY_EVERY_SECONDS
                    latency = json.dumps(state.metrics.recent.summary(), separators=(",", ":")).encode()
                    await response.write(b"event: latency\ndata: " + latency + b"\n\n")
                if state.stopping:
                    break
    except ConnectionError:
        pass  # the page went away: nothing to clean up
    return response
