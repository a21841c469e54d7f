"""A Redis that fails over, as `iterserve up --redis-replicas N` runs it (and the tests): a primary,
N replicas of it and three Sentinels on this host, each its own redis-server process.

The Sentinels agree (a quorum of 2) that the primary is down after DOWN_AFTER_MS without an answer
and promote a replica; a primary that comes back is made a replica of the new one. Every service
connects through the Sentinels (shared/redis_connection.py, a redis+sentinel:// URL), so its next
connection after a promotion goes to the new primary; the scheduler sees another Redis server (a
new run_id) and loads the pool from what it holds, as after a restart (docs/operations.md,
"Redis that fails over"). Replication is asynchronous: the gateway accepts a request once a replica
holds it (Settings.redis_wait_replicas, Redis's WAIT), so a promotion loses no accepted request; the
token entries a promoted replica lacks are sampled again, the same tokens (seeds make them so).
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import redis

SENTINELS = 3
QUORUM = 2
PRIMARY_NAME = "iterserve"  # the name the Sentinels monitor the primary under
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
# how long a lost primary waits for the Sentinels to promote a replica before it is started again as
# the primary itself (no replica could take over)
PROMOTION_WAIT_SECONDS = (DOWN_AFTER_MS + FAILOVER_TIMEOUT_MS) / 1000


@dataclass(frozen=True)
class RedisGroup:
    data_dir: Path
    primary_port: int
    replica_ports: tuple[int, ...]
    sentinel_ports: tuple[int, ...]
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        """Every service's Redis URL: through the Sentinels."""
        sentinels = ",".join(f"{self.host}:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{sentinels}/{PRIMARY_NAME}/0"

    def server_url(self, port: int) -> str:
        return f"redis://{self.host}:{port}/0"

    def servers(self) -> dict[str, int]:
        """The redis-servers' names and ports (not the Sentinels'), the first one primary at start."""
        return {"redis": self.primary_port} | {f"replica-{index}": port for index, port in enumerate(self.replica_ports)}

    def server_command(self, binary: str, name: str, primary_port: int, promotable: bool = True) -> list[str]:
        """A redis-server's command line: the primary's, or a replica's of the primary at primary_port;
        not promotable (replica-priority 0) until promotable_once_synced says otherwise: a server
        started again holds its own old data until it has synced, and promoted before that (the new
        primary missing its Sentinels' pings for DOWN_AFTER_MS under load) it would throw away
        everything written since it was lost."""
        port = self.servers()[name]
        directory = self.data_dir / name
        directory.mkdir(parents=True, exist_ok=True)
        replica = [] if port == primary_port else ["--replicaof", self.host, str(primary_port)]
        if replica and not promotable:
            replica += ["--replica-priority", "0"]
        return [binary, "--port", str(port), "--bind", self.host, "--save", "", "--appendonly", "yes",
                "--appendfsync", "everysec", "--dir", str(directory), *replica]

    def commands(self, binary: str) -> list[tuple[str, list[str]]]:
        """(name, command line) of every process: the primary, the replicas, then the Sentinels (each
        Sentinel's configuration file written here: a Sentinel rewrites its own as it learns)."""
        commands = [(name, self.server_command(binary, name, self.primary_port)) for name in self.servers()]
        for index, port in enumerate(self.sentinel_ports):
            directory = self.data_dir / f"sentinel-{index}"
            directory.mkdir(parents=True, exist_ok=True)
            config = directory / "sentinel.conf"
            # (told of the replicas and of each other here: on its own a Sentinel learns of replicas
            # from the primary's INFO every 10 s, and could promote none until then)
            replicas = "".join(f"sentinel known-replica {PRIMARY_NAME} {self.host} {replica}\n"
                               for replica in self.replica_ports)
            others = "".join(f"sentinel known-sentinel {PRIMARY_NAME} {self.host} {other} {sentinel_id(other)}\n"
                             for other in self.sentinel_ports if other != port)
            config.write_text(
                f"port {port}\nbind {self.host}\ndir {directory}\nsentinel myid {sentinel_id(port)}\n"
                f"sentinel monitor {PRIMARY_NAME} {self.host} {self.primary_port} {QUORUM}\n"
                f"sentinel down-after-milliseconds {PRIMARY_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {PRIMARY_NAME} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {PRIMARY_NAME} 1\n{replicas}{others}")
            commands.append((f"sentinel-{index}", [binary, str(config), "--sentinel"]))
        return commands


def sentinel_id(port: int) -> str:
    """A Sentinel's run id (40 hex digits), set in its configuration so the others can be told it."""
    return hashlib.sha1(f"iterserve-sentinel-{port}".encode()).hexdigest()


def agreed_primary(group: RedisGroup, timeout: float = 0.5) -> int | None:
    """The port of the primary every Sentinel that answers names, or None when they disagree (a
    failover under way) or none answers. A server that stopped is started again as a replica of
    this one, never as a primary beside it (clients that asked a Sentinel not yet told of a
    promotion would write to it)."""
    named = set()
    for port in group.sentinel_ports:
        client = redis.Redis(host=group.host, port=port, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            address = client.sentinel_get_master_addr_by_name(PRIMARY_NAME)
        except (redis.exceptions.RedisError, OSError):
            continue
        finally:
            client.close()
        named.add(int(address[1]) if address else None)
    return named.pop() if len(named) == 1 else None


def restart_under(group: RedisGroup, name: str, down_for: float) -> int | None:
    """The primary's port that the lost server `name`, down for `down_for` seconds, starts again
    under (its own: as the primary), or None to wait. A lost primary waits for the promotion: the
    Sentinels notice it is gone only after DOWN_AFTER_MS and promote a replica some time later; one
    started again as the primary before that either keeps the group from failing over or is made a
    replica under the clients that wrote to it in between."""
    primary = agreed_primary(group)
    if primary is None:
        return None  # a failover under way
    if primary == group.servers()[name] and down_for < PROMOTION_WAIT_SECONDS:
        return None
    return primary


def promotable_once_synced(group: RedisGroup, name: str, timeout: float = 0.5) -> bool:
    """True once the server `name` (started with promotable=False) is a replica in sync with its
    primary, and has been made promotable again; False while it is not (yet)."""
    client = redis.Redis(host=group.host, port=group.servers()[name], socket_connect_timeout=timeout,
                         socket_timeout=timeout)
    try:
        replication = client.info("replication")
        if replication.get("role") != "slave" or replication.get("master_link_status") != "up" \
                or replication.get("master_sync_in_progress"):
            return False
        client.config_set("replica-priority", 100)
        return True
    except (redis.exceptions.RedisError, OSError):
        return False
    finally:
        client.close()
