"""Every Redis key and stream name used by iterserve, in one place.

All keys live under one prefix so several deployments can share a Redis.
"""

PREFIX = "iterserve"

# Stream of new request ids (gateway -> scheduler). Entries: {"id": request_id}.
NEW_REQUESTS_STREAM = f"{PREFIX}:requests:new"
# Stream of cancellations (gateway -> scheduler). Entries: {"id": request_id}.
CANCEL_STREAM = f"{PREFIX}:requests:cancel"
# Set of request ids accepted and not yet finished: the scheduler rebuilds its pool from it.
ACTIVE_REQUESTS_SET = f"{PREFIX}:requests:active"
# Stream of plan results (workers -> scheduler).
RESULTS_STREAM = f"{PREFIX}:results"
# Stream of the scheduler's per-iteration records (capped), for tests and observability.
ITERATIONS_STREAM = f"{PREFIX}:iterations"
# Set of worker ids that have registered; each one's liveness is its heartbeat key.
WORKERS_SET = f"{PREFIX}:workers"
# Scheduler liveness key (value: msgpack SchedulerInfo, expires unless renewed).
SCHEDULER_HEARTBEAT = f"{PREFIX}:scheduler:heartbeat"


def request_key(request_id: str) -> str:
    """Hash holding one request: its RequestRecord and its status."""
    return f"{PREFIX}:request:{request_id}"


def token_stream(request_id: str) -> str:
    """Stream of one request's output (scheduler -> gateway), one entry per token."""
    return f"{PREFIX}:tokens:{request_id}"


def plan_stream(worker_id: str) -> str:
    """Stream of batch plans addressed to one worker (scheduler -> worker)."""
    return f"{PREFIX}:plans:{worker_id}"


def worker_heartbeat(worker_id: str) -> str:
    """One worker's liveness key (value: msgpack WorkerInfo, expires unless renewed)."""
    return f"{PREFIX}:worker:{worker_id}"
