"""What every handler of one gateway app shares: settings, tokenizer, Redis client, metrics."""

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from services.gateway.errors import ApiError, unknown_model
from services.gateway.metrics import GatewayMetrics
from services.gateway.store import RequestState, Store
from shared.config import Settings
from shared.keys import ModelKeys

if TYPE_CHECKING:
    from services.gateway.admission import Admission
    from shared.messages import SchedulerInfo, StructuredOutput
    from shared.tokenizer import Tokenizer

log = logging.getLogger("iterserve.gateway")

BACKGROUND_DRAIN_SECONDS = 5.0  # how long shutdown waits for pending cancellations


@dataclass(frozen=True)
class GatewayModel:
    """One served model as the gateway sees it: its API name, tokenizer, context and pool's keys."""

    name: str
    tokenizer: "Tokenizer"
    context_length: int
    keys: ModelKeys
    # The grammar compiler of its tokenizer, made on first use (a frozen dataclass holds it in a dict)
    _grammars: dict = field(default_factory=dict, compare=False, repr=False)
    _grammar_lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def check_constraint(self, constraint: "StructuredOutput") -> None:
        """Raise InvalidConstraint when the workers could not compile it (run off the event loop: the
        first call builds the grammar engine's tokenizer, about 0.2 s; a new schema takes 0.2-2 ms)."""
        from shared.grammar import GrammarCompiler

        with self._grammar_lock:
            if "compiler" not in self._grammars:
                self._grammars["compiler"] = GrammarCompiler(self.tokenizer)
            self._grammars["compiler"].check(constraint)


@dataclass
class GatewayState:
    settings: Settings
    models: dict[str, GatewayModel]  # by API name, in the order served: the first is the default
    metrics: GatewayMetrics
    started_at: int  # unix seconds: the model's `created`
    store: Store | None = None  # opened on app startup
    admission: "Admission | None" = None  # API keys and the limits on what callers may hold
    background: set[asyncio.Task] = field(default_factory=set)
    # Set when the gateway shuts down: the connections it closes are not clients leaving, so their
    # requests go on (a client re-attaches through another or a restarted gateway).
    stopping: bool = False
    # The executors of each model's workers as its scheduler last said (SchedulerInfo.executors): every
    # answer names them (x-iterserve-executor), so a figure read off an emulated system says so.
    executors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    executors_task: "asyncio.Task | None" = None  # what keeps `executors` current (app.py _follow_executors)

    def note_executors(self, model_name: str, scheduler: "SchedulerInfo | None") -> None:
        if scheduler is not None and scheduler.executors:
            self.executors[model_name] = tuple(scheduler.executors)

    @property
    def executor_header(self) -> str:
        """"engine", "emulated", or both joined ("emulated,engine") when the models' workers differ."""
        return ",".join(sorted(set().union(*self.executors.values()))) or "unknown"

    @property
    def default_model(self) -> GatewayModel:
        """The model of requests that name none (the first served)."""
        return next(iter(self.models.values()))

    @property
    def tokenizer(self) -> "Tokenizer":
        return self.default_model.tokenizer

    @property
    def model_name(self) -> str:
        return self.default_model.name

    @property
    def context_length(self) -> int:
        return self.default_model.context_length

    def model(self, name: str | None) -> GatewayModel:
        """The served model a request names (the default when it names none); 404 for another."""
        if name is None:
            return self.default_model
        found = self.models.get(name)
        if found is None:
            raise unknown_model(name, ", ".join(f"`{served}`" for served in self.models))
        return found

    def model_of(self, request_state: RequestState) -> GatewayModel:
        """The model a stored request was sent to."""
        return self.models.get(request_state.model) or self.default_model

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
            await self.store.cancel(request_id, self.model_of(request_state).keys)
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
