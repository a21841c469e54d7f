"""One way to connect to Redis, used by every service: retries with backoff on connection loss."""

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

RECONNECT_ERRORS = (ConnectionError, TimeoutError, BusyLoadingError, OSError)


def connect(redis_url: str) -> aioredis.Redis:
    """A client that retries a command through short outages (e.g. a Redis restart)."""
    return aioredis.Redis.from_url(
        redis_url,
        decode_responses=False,
        health_check_interval=10,
        socket_connect_timeout=2,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=20),
        retry_on_error=list(RECONNECT_ERRORS),
    )
