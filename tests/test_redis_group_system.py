"""`iterserve up --redis-replicas 1` as a user runs it: a primary, a replica and three Sentinels
beside the services, every service through the Sentinels. Its primary SIGKILLed: the Sentinels
promote the replica and the system serves on; `up` starts the lost server again as a replica of
the new primary (never as a second primary), promotable once in sync; a stop leaves no process behind."""

import re
import time

import psutil
import pytest
import redis

from tests.system import System, assert_emulated_completion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def redis_servers(system: System) -> dict[int, psutil.Process]:
    """`up`'s redis-servers (not its Sentinels), by port."""
    servers = {}
    for process in system.descendants():
        try:
            command = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        # (redis-server sets its title: "redis-server 127.0.0.1:PORT", "... [sentinel]" for a Sentinel)
        title = re.match(r"\S*redis-server \S*:(\d+)(.*)", " ".join(command))
        if title and "sentinel" not in title.group(2):
            servers[int(title.group(1))] = process
    return servers


def role(port: int) -> str | None:
    client = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        return client.info("replication")["role"]
    except redis.exceptions.RedisError:
        return None
    finally:
        client.close()


def priority(port: int) -> str | None:
    """Its replica-priority: "0" while it may not be promoted."""
    client = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        return client.config_get("replica-priority").get("replica-priority")
    except redis.exceptions.RedisError:
        return None
    finally:
        client.close()


def test_up_with_a_replica_fails_over_and_serves_on():
    with System("--redis-replicas", "1", "--executor", "emulated", "--hardware", "h100-qwen2.5-32b",
                workers=1) as system:
        assert re.search(r"event=up redis=redis\+sentinel://(127\.0\.0\.1:\d+,){2}127\.0\.0\.1:\d+/iterserve/0",
                         system.log()), system.log()[-2000:]
        primary_port = int(re.search(r"event=redis_group primary=(\d+)", system.log()).group(1))
        assert_emulated_completion(system.base_url)
        servers = redis_servers(system)
        assert len(servers) == 2 and role(primary_port) == "master"
        servers[primary_port].kill()
        deadline = time.monotonic() + 60
        while True:  # served again once the replica is promoted (the gateway's 503s meanwhile are retried)
            try:
                assert_emulated_completion(system.base_url, seed=7)
                break
            except Exception:
                assert time.monotonic() < deadline, system.log()[-3000:]
                time.sleep(0.5)
        while True:  # the lost server back, a replica of the new primary, promotable once in sync
            if primary_port in redis_servers(system) and role(primary_port) == "slave" \
                    and priority(primary_port) == "100":
                break
            assert time.monotonic() < deadline, system.log()[-3000:]
            time.sleep(0.2)
        assert "redis_restarted" in system.log()  # the scheduler loaded the pool from the new primary
        assert not system.stop(), "`up` left processes behind"
