"""What every handler of one gateway app shares: settings, tokenizer, Redis client, metrics."""

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from services.gateway.store import Store
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from shared.config import Settings

if TYPE_CHECKING:
    from services.gateway.admission import Admission
    from shared.tokenizer import Tokenizer

log = logging.getLogger("iterserve.gateway")

BACKGROUND_DRAIN_SECONDS = 5.0  # how long shutdown waits for pending cancellations


@dataclass
class GatewayState:
    settings: Settings
    tokenizer: "Tokenizer"
    model_name: str  # the only value of `model` the endpoints accept
    context_length: int
    metrics: GatewayMetrics
    started_at: int  # unix seconds: the model's `created`
    store: Store | None = None  # opened on app startup
    admission: "Admission | None" = None  # API keys and the limits on what callers may hold
    background: set[asyncio.Task] = field(default_factory=set)
    # Set when the gateway shuts down: the connections it closes are not clients leaving, so their
    # requests go on (a client re-attaches through another or a restarted gateway).
    stopping: bool = False

    def cancel_in_background(self, request_id: str, reason: str) -> None:
        """Cancel a request from a handler that is itself being cancelled (its client went away)."""
        task = asyncio.get_running_loop().create_task(self._cancel_unless_finished(request_id, reason))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cancel_unless_finished(self, request_id: str, reason: str) -> None:
        try:
            request_state = await self.store.request_state(request_id)
            if request_state is not None and request_state.terminal:
                log.info("not cancelling id=%s status=%s reason=%s", request_id, request_state.status, reason)
                return
            await self.store.cancel(request_id)
            log.info("cancel sent id=%s reason=%s", request_id, reason)
        except ApiError as error:
            log.warning("cancel failed id=%s reason=%s error=%s", request_id, reason, error.message)

    async def drain_background(self) -> None:
        if self.background:
            await asyncio.wait(list(self.background), timeout=BACKGROUND_DRAIN_SECONDS)


STATE = web.AppKey("gateway_state", GatewayState)
ENDPOINT = web.RequestKey("endpoint", str)  # set by generation handlers: the error middleware counts per endpoint
CLIENT_KEY = web.RequestKey("client_key", str)  # set by the access middleware: the caller's key id
ANSWER = web.RequestKey("answer", object)  # the accepted request's Answer: counts its own outcome once
