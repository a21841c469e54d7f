"""One way to connect to Redis, used by every service: retries with backoff on connection loss.

A URL is a plain Redis's (redis://, rediss://, unix://) or, for a primary that fails over, its
Sentinels' (redis+sentinel://[:password@]host:port[,host:port...]/primary-name[/db], or
rediss+sentinel://...?ssl_ca_certs=PATH for TLS to the Sentinels and to the servers alike, with
rediss://'s ssl_* options): the client asks the Sentinels for the primary's address on every connect,
so after a promotion its next connection goes to the new primary (redis-py's SentinelConnectionPool).
The password is the primary's; the Sentinels are asked without one.
"""

import socket
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, ConnectionError, ResponseError, TimeoutError

RECONNECT_ERRORS = (ConnectionError, TimeoutError, BusyLoadingError, OSError)
# The gateway holds one connection per request it follows (a blocking XREAD): redis-py's default
# pool of 100 would refuse the 101st concurrent request (MaxConnectionsError). Redis's own
# default limit is 10000 clients.
MAX_CONNECTIONS = 8192


# A connection to a host that is gone (cut off, powered down: no reset comes) is given up within
# about 5 s rather than TCP's 15 minutes: keepalive probes after 2 s of silence (a blocked XREAD
# is silence), 1 s apart, 3 unanswered; and data unacknowledged for 5 s. Then every client's own
# retry reconnects (through the Sentinels: to the primary they name now).
KEEPALIVE_OPTIONS = {option: value for option, value in (
    (getattr(socket, "TCP_KEEPIDLE", None), 2), (getattr(socket, "TCP_KEEPINTVL", None), 1),
    (getattr(socket, "TCP_KEEPCNT", None), 3), (getattr(socket, "TCP_USER_TIMEOUT", None), 5000)) if option is not None}
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
TLS_OPTIONS = ("ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
SENTINEL_TIMEOUT_SECONDS = 2.0  # one question to one Sentinel


class BadRedisUrl(ValueError):
    """A Redis URL that cannot be used (said at start, not retried)."""


@dataclass(frozen=True)
class SentinelTarget:
    """A primary found through its Sentinels."""

    sentinels: tuple[tuple[str, int], ...]
    primary: str  # the name the Sentinels monitor it under
    password: str | None
    db: int
    tls: dict[str, object] | None = None  # rediss+sentinel://: redis-py's ssl options (Sentinels and servers)

    def tls_options(self) -> dict[str, object]:
        return {} if self.tls is None else {"ssl": True, **self.tls}


def sentinel_target(redis_url: str) -> SentinelTarget | None:
    """The Sentinels and primary a redis+sentinel:// URL names (None for another URL); BadRedisUrl
    when it names no Sentinel or no primary."""
    scheme, _, rest = redis_url.partition("://")
    if scheme not in SENTINEL_SCHEMES:
        return None
    hosts, _, path = rest.partition("/")
    password = None
    if "@" in hosts:
        credentials, _, hosts = hosts.rpartition("@")
        password = unquote(credentials.partition(":")[2]) or None
    sentinels = []
    for host in filter(None, hosts.split(",")):
        name, _, port = host.rpartition(":")  # (an IPv6 address in brackets: [::1]:26379)
        if not name or not port.isdigit():
            raise BadRedisUrl(f"{redacted(redis_url)}: a Sentinel is host:port, got {host!r}")
        sentinels.append((name.strip("[]"), int(port)))
    path, _, query = path.partition("?")
    tls = None
    if scheme == "rediss+sentinel":
        tls = {}
        for pair in filter(None, query.split("&")):
            name, _, value = pair.partition("=")
            if name not in TLS_OPTIONS:
                raise BadRedisUrl(f"{redacted(redis_url)}: unknown option {name!r} (TLS takes {', '.join(TLS_OPTIONS)})")
            tls[name] = value.lower() in ("1", "true", "yes") if name == "ssl_check_hostname" else unquote(value)
    elif query:
        raise BadRedisUrl(f"{redacted(redis_url)}: options after '?' are TLS's, for rediss+sentinel://")
    primary, _, db = path.partition("/")
    if not sentinels or not primary:
        raise BadRedisUrl(f"{redacted(redis_url)}: a Sentinel URL is "
                          "redis+sentinel://[:password@]host:port[,host:port...]/primary-name[/db] "
                          "(rediss+sentinel://...?ssl_ca_certs=PATH for TLS)")
    if db and not db.isdigit():
        raise BadRedisUrl(f"{redacted(redis_url)}: the database is a number, got {db!r}")
    return SentinelTarget(tuple(sentinels), primary, password, int(db or 0), tls)


def connect(redis_url: str) -> aioredis.Redis:
    """A client that retries a command through short outages (e.g. a Redis restart, a failover)."""
    target = sentinel_target(redis_url)
    # Through Sentinels, a command gives up after a few tries: redis-py connects under its pool's lock,
    # so one connection retrying towards a primary that is gone holds up every command of the client
    # (seen: a client that never recovered after a promotion). The services' own loops retry instead.
    retries = 20 if target is None else 2
    options = dict(
        decode_responses=False,
        health_check_interval=10,
        socket_connect_timeout=2,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=retries),
        retry_on_error=list(RECONNECT_ERRORS),
        max_connections=MAX_CONNECTIONS,
    )
    if not redis_url.startswith("unix:"):
        options |= {"socket_keepalive": True, "socket_keepalive_options": KEEPALIVE_OPTIONS}
    if target is None:
        return aioredis.Redis.from_url(redis_url, **options)
    sentinel = aiosentinel.Sentinel(list(target.sentinels), sentinel_kwargs={
        "socket_connect_timeout": SENTINEL_TIMEOUT_SECONDS, "socket_timeout": SENTINEL_TIMEOUT_SECONDS,
        "socket_keepalive": True, "socket_keepalive_options": KEEPALIVE_OPTIONS, **target.tls_options()})
    return sentinel.master_for(target.primary, redis_class=aioredis.Redis, password=target.password, db=target.db,
                               **options, **target.tls_options())


def sync_client(redis_url: str, timeout: float) -> redis.Redis:
    """A blocking client (start-up checks, tools), through the Sentinels for a Sentinel URL."""
    target = sentinel_target(redis_url)
    if target is None:
        return redis.Redis.from_url(redis_url, socket_connect_timeout=timeout, socket_timeout=timeout)
    sentinel = redis.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs={
        "socket_connect_timeout": timeout, "socket_timeout": timeout, **target.tls_options()})
    return sentinel.master_for(target.primary, password=target.password, db=target.db,
                               socket_connect_timeout=timeout, socket_timeout=timeout, **target.tls_options())


def sentinel_error(redis_url: str, timeout: float = 3.0) -> str | None:
    """Why a Sentinel URL cannot be served (no Sentinel answers, none knows the primary), or None."""
    target = sentinel_target(redis_url)
    if target is None:
        return None
    answered = []
    for host, port in target.sentinels:
        client = redis.Redis(host=host, port=port, socket_connect_timeout=timeout, socket_timeout=timeout,
                             **target.tls_options())
        try:
            answered.append(client.sentinel_get_master_addr_by_name(target.primary))
        except (ConnectionError, TimeoutError, OSError, ResponseError):
            continue
        finally:
            client.close()
    if not answered:
        hosts = ",".join(f"{host}:{port}" for host, port in target.sentinels)
        return f"no Sentinel of {hosts} answers: start them, or fix the URL"
    if not any(answered):
        return f"the Sentinels do not monitor a primary named {target.primary!r}"
    return None


def redacted(redis_url: str) -> str:
    """The URL without its password, for logs."""
    if redis_url.partition("://")[0] in SENTINEL_SCHEMES:
        scheme, _, rest = redis_url.partition("://")
        if "@" in rest.partition("/")[0]:
            rest = "***@" + rest.partition("@")[2]
        return f"{scheme}://{rest}"
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
    try:
        if problem := sentinel_error(redis_url, timeout):
            return problem
    except BadRedisUrl as error:
        return str(error)
    client = sync_client(redis_url, timeout)
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
