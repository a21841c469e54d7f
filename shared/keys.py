"""Every Redis key and stream name used by iterserve, in one place.

All keys live under one prefix so several deployments can share a Redis.
"""

import re

PREFIX = "iterserve"
# What a request id may look like (the gateway's are cmpl-<32 hex> and chatcmpl-<32 hex>): an id
# read from Redis that does not match is malformed input, skipped.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

# Stream of new request ids (gateway -> scheduler). Entries: {"id": request_id}.
NEW_REQUESTS_STREAM = f"{PREFIX}:requests:new"
# Stream of cancellations (gateway -> scheduler). Entries: {"id": request_id}.
CANCEL_STREAM = f"{PREFIX}:requests:cancel"
# Set of request ids accepted and not yet finished: the scheduler rebuilds its pool from it.
ACTIVE_REQUESTS_SET = f"{PREFIX}:requests:active"
# Stream of plan results (workers -> scheduler).
RESULTS_STREAM = f"{PREFIX}:results"
# Stream of the scheduler's per-iteration records (the last Settings.iteration_records), for tests
# and observability.
ITERATIONS_STREAM = f"{PREFIX}:iterations"
# Set of worker ids that have registered; each one's liveness is its heartbeat key.
WORKERS_SET = f"{PREFIX}:workers"
# Scheduler liveness key (value: msgpack SchedulerInfo, expires unless renewed).
SCHEDULER_HEARTBEAT = f"{PREFIX}:scheduler:heartbeat"


def request_key(request_id: str) -> str:
    """Hash holding one request: its RequestRecord and its status (and CANCEL_FLAG once cancelled)."""
    return f"{PREFIX}:request:{request_id}"


# Field of request_key(id) set by the gateway with the cancel: a scheduler that loads the request
# later (it had not read its new-request entry yet, or it restarted) sees the cancel there, so
# the cancel stream itself can be trimmed as soon as it is read.
CANCEL_FLAG = "cancel"


def token_stream(request_id: str) -> str:
    """Stream of one request's output (scheduler -> gateway), one entry per token."""
    return f"{PREFIX}:tokens:{request_id}"


def plan_stream(worker_id: str) -> str:
    """Stream of batch plans addressed to one worker (scheduler -> worker)."""
    return f"{PREFIX}:plans:{worker_id}"


def worker_heartbeat(worker_id: str) -> str:
    """One worker's liveness key (value: msgpack WorkerInfo, expires unless renewed)."""
    return f"{PREFIX}:worker:{worker_id}"


def valid_request_id(value: bytes | str | None) -> str | None:
    """The request id held in a Redis value, or None when it is not one (any bytes may be there)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str) and REQUEST_ID_PATTERN.fullmatch(value):
        return value
    return None
