"""Who may use the API, and how much of the server a caller may hold (admission control).

API keys: configured keys (ITERSERVE_API_KEYS, ITERSERVE_API_KEYS_FILE) make every /v1/* request
need `Authorization: Bearer <key>` (401 otherwise), and /tokenize and /detokenize too; /health and
/openapi.json stay open, /metrics and /status too unless protect_observability. Requests carry a key's id (`key-` + 16 hex digits
of its SHA-256), never the key: the scheduler shares turns by it, and only the same key can look
up, cancel or re-attach to a request.

Bounded admission: a request counts as waiting from its acceptance to its first output token
(queued, or its prompt being prefilled). The gateway refuses a new request with 429 and
Retry-After when the waiting requests or their prompt tokens would pass their limits, taking as
the number waiting the larger of its own count (exact, updated in the same event-loop step as
the check) and the scheduler's heartbeat (covers other gateways and requests re-queued after a
fault; up to a heartbeat old). One key may also hold at most max_streams_per_key generation
responses open at once (streamed or not, re-attached streams included), so one key can never
take the whole queue. None of these counts lives in Redis: nothing can leak when a process dies.
"""

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from services.gateway.errors import ApiError
from shared.config import Settings
from shared.exits import configuration_error
from shared.messages import SchedulerInfo

log = logging.getLogger("iterserve.gateway")

OPEN_KEY_ID = ""  # the client key of every request when no key is configured
SCHEDULER_VIEW_SECONDS = 0.25  # how long a read of the scheduler's heartbeat is reused
RETRY_AFTER_SECONDS = 1


def load_api_keys(settings: Settings) -> list[str]:
    """The configured keys: ITERSERVE_API_KEYS (comma-separated) and the lines of ITERSERVE_API_KEYS_FILE."""
    keys = [key.strip() for key in settings.api_keys.split(",")]
    if settings.api_keys_file:
        path = Path(settings.api_keys_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as error:
            raise configuration_error(f"iterserve gateway: cannot read the API keys file {path}: {error}") from None
        keys += [line.strip() for line in lines if not line.strip().startswith("#")]
    keys = [key for key in keys if key]
    if settings.api_keys_file and not keys:
        raise configuration_error(f"iterserve gateway: the API keys file {settings.api_keys_file} holds no key")
    return keys


def key_id(key: str) -> str:
    """A stable, non-secret name of a key (logs, fairness, request ownership)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def unauthorized(message: str, code: str | None) -> ApiError:
    return ApiError(401, message, code=code, headers={"WWW-Authenticate": 'Bearer realm="iterserve"'})


def too_many(message: str) -> ApiError:
    return ApiError(
        429,
        message,
        error_type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


@dataclass
class Ticket:
    """One open generation response: counted as waiting until its first token, open until closed."""

    admission: "Admission"
    client_key: str
    prompt_tokens: int
    waiting: bool
    open: bool = True

    def started(self) -> None:
        """Its first token arrived: no longer waiting."""
        if self.waiting:
            self.waiting = False
            self.admission.waiting_requests -= 1
            self.admission.waiting_prompt_tokens -= self.prompt_tokens

    def close(self) -> None:
        if not self.open:
            return
        self.started()
        self.open = False
        streams = self.admission.open_streams
        streams[self.client_key] -= 1
        if streams[self.client_key] <= 0:
            del streams[self.client_key]


class Admission:
    def __init__(self, settings: Settings, api_keys: list[str]) -> None:
        self.settings = settings
        self._key_ids = {hashlib.sha256(key.encode()).digest(): key_id(key) for key in api_keys}
        self.waiting_requests = 0  # this gateway's requests with no output token yet
        self.waiting_prompt_tokens = 0
        self.open_streams: dict[str, int] = {}  # client key -> open generation responses
        self._scheduler: SchedulerInfo | None = None
        self._scheduler_read_at = float("-inf")

    @property
    def keys_required(self) -> bool:
        return bool(self._key_ids)

    def protects(self, path: str) -> bool:
        if not self.keys_required:
            return False
        if path.startswith("/v1/") or path in ("/v1", "/dashboard/events", "/tokenize", "/detokenize"):
            return True
        return self.settings.protect_observability and path in ("/metrics", "/status")

    def client_key(self, request: web.Request) -> str:
        """The caller's key id; raises a 401 ApiError when keys are required and none valid is given."""
        if not self.keys_required:
            return OPEN_KEY_ID
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if not header:
            raise unauthorized(
                "You didn't provide an API key: send it in the header `Authorization: Bearer <key>`.", None
            )
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("Malformed Authorization header: expected `Bearer <key>`.", "invalid_api_key")
        found = self._key_ids.get(hashlib.sha256(token.encode(errors="replace")).digest())
        if found is None:
            raise unauthorized("Incorrect API key provided.", "invalid_api_key")
        return found

    def needs_scheduler_view(self) -> bool:
        return time.monotonic() - self._scheduler_read_at > SCHEDULER_VIEW_SECONDS

    def note_scheduler(self, info: SchedulerInfo | None) -> None:
        self._scheduler, self._scheduler_read_at = info, time.monotonic()

    def open_stream(self, client_key: str) -> Ticket:
        """A response that follows a request's output (a re-attach): counted against the key only."""
        self._check_streams(client_key)
        self.open_streams[client_key] = self.open_streams.get(client_key, 0) + 1
        return Ticket(self, client_key, 0, waiting=False)

    def admit(self, client_key: str, prompt_tokens: int) -> Ticket:
        """Reserve a place for a new request, or raise a 429 ApiError. No await between check and count."""
        self._check_streams(client_key)
        settings, scheduler = self.settings, self._scheduler
        waiting = max(self.waiting_requests, scheduler.waiting if scheduler else 0)
        if waiting + 1 > settings.max_waiting_requests:
            raise too_many(
                f"The server is busy: {waiting} requests are waiting to start (the limit is "
                f"{settings.max_waiting_requests}). Retry after {RETRY_AFTER_SECONDS} s."
            )
        tokens = max(self.waiting_prompt_tokens, scheduler.waiting_tokens if scheduler else 0)
        if tokens > 0 and tokens + prompt_tokens > settings.max_waiting_prompt_tokens:
            raise too_many(
                f"The server is busy: {tokens} prompt tokens are waiting to start and this request has "
                f"{prompt_tokens} (the limit is {settings.max_waiting_prompt_tokens}). "
                f"Retry after {RETRY_AFTER_SECONDS} s."
            )
        self.waiting_requests += 1
        self.waiting_prompt_tokens += prompt_tokens
        self.open_streams[client_key] = self.open_streams.get(client_key, 0) + 1
        return Ticket(self, client_key, prompt_tokens, waiting=True)

    def _check_streams(self, client_key: str) -> None:
        limit = self.settings.max_streams_per_key
        if self.open_streams.get(client_key, 0) >= limit:
            whose = "this API key" if client_key else "this server (no API keys configured)"
            raise too_many(
                f"Too many open requests: {limit} are already open for {whose}, the limit. "
                "Wait for one to finish, or retry later."
            )
