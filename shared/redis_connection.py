"""One way to connect to Redis, used by every service: retries with backoff on connection loss."""

from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, ConnectionError, ResponseError, TimeoutError

RECONNECT_ERRORS = (ConnectionError, TimeoutError, BusyLoadingError, OSError)
# The gateway holds one connection per request it follows (a blocking XREAD): redis-py's default
# pool of 100 would refuse the 101st concurrent request (MaxConnectionsError). Redis's own
# default limit is 10000 clients.
MAX_CONNECTIONS = 8192


def connect(redis_url: str) -> aioredis.Redis:
    """A client that retries a command through short outages (e.g. a Redis restart)."""
    return aioredis.Redis.from_url(
        redis_url,
        decode_responses=False,
        health_check_interval=10,
        socket_connect_timeout=2,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=20),
        retry_on_error=list(RECONNECT_ERRORS),
        max_connections=MAX_CONNECTIONS,
    )


def redacted(redis_url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(redis_url)
    if parts.password is None:
        return redis_url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def credentials_error(redis_url: str, timeout: float = 3.0) -> str | None:
    """Why Redis refuses this URL's credentials (wrong or missing password), or None.

    Checked once at start-up, so a wrong password stops a service with a clear message instead of
    a retry loop. A Redis that does not answer yet is not an error here: the services retry.
    """
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        client.ping()
    except AuthenticationError as error:
        return f"Redis at {redacted(redis_url)} refused the credentials: {error}"
    except ResponseError as error:
        if "NOAUTH" in str(error) or "WRONGPASS" in str(error):
            return f"Redis at {redacted(redis_url)} needs a password (redis://:PASSWORD@host:port/0): {error}"
        return None
    except (ConnectionError, TimeoutError, BusyLoadingError, OSError):
        return None
    finally:
        client.close()
    return None
