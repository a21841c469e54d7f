"""REDIS_URL with a password and over TLS (rediss://), as every service connects
(shared/redis_connection.py). The whole system on a password-protected Redis is in
tests/test_admission_system.py."""

import shutil
import sys
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from shared.redis_connection import connect, credentials_error, redacted
from tests.redis_server import RedisProcess, free_port
from tests.requirements import skip_unless_ci

pytestmark = pytest.mark.timeout(60)


def test_redacted_hides_only_the_password():
    assert redacted("redis://:s3cret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redacted("rediss://app:s3cret@cache:6380/2?ssl_cert_reqs=none") == (
        "rediss://app:***@cache:6380/2?ssl_cert_reqs=none")
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_credentials_are_checked_once_at_start():
    server = RedisProcess(password="right").start()
    try:
        port = server.port
        assert credentials_error(f"redis://:right@127.0.0.1:{port}/0") is None
        wrong = credentials_error(f"redis://:wrong@127.0.0.1:{port}/0")
        assert wrong and "refused the credentials" in wrong and ":***@" in wrong and "wrong@" not in wrong
        assert "refused the credentials" in credentials_error(f"redis://127.0.0.1:{port}/0")
    finally:
        server.close()
    assert credentials_error(f"redis://:x@127.0.0.1:{free_port()}/0", timeout=0.5) is None, (
        "a Redis that does not answer yet is for the services' retries, not an error")


@pytest.fixture
def tls_redis():
    """redis-server with TLS only (no plain port) and a password, its certificate made here."""
    if shutil.which("openssl") is None or shutil.which("redis-server") is None:
        skip_unless_ci("needs openssl and redis-server")
    directory = Path(tempfile.mkdtemp(prefix="iterserve-tls-"))
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
         str(cert), "--tls-auth-clients", "no", "--requirepass", "tls-pw", "--dir", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"rediss://:tls-pw@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
                client.ping()
                client.close()
                break
            except redis.exceptions.RedisError:
                if process.poll() is not None:
                    skip_unless_ci("this redis-server was built without TLS")
                assert time.monotonic() < deadline, "TLS redis-server did not start"
                time.sleep(0.1)
        yield url, port, cert
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


async def test_rediss_with_a_password_works_for_the_services_client(tls_redis):
    url, port, cert = tls_redis
    assert credentials_error(url) is None
    wrong = credentials_error(f"rediss://:nope@127.0.0.1:{port}/0?ssl_ca_certs={cert}")
    assert wrong and "refused the credentials" in wrong
    client = connect(url)  # what the gateway, the scheduler and every worker use
    try:
        await client.xadd("iterserve:tls-check", {"m": b"\x81\xa1k\x01"})
        [[_, [(_, fields)]]] = await client.xread({"iterserve:tls-check": "0-0"}, count=1)
        assert fields == {b"m": b"\x81\xa1k\x01"}
    finally:
        await client.aclose()
    plain = f"redis://:tls-pw@127.0.0.1:{port}/0"  # TLS-only: a plain connection never gets an answer
    assert credentials_error(plain, timeout=1.0) is None


def test_sentinel_urls_name_their_sentinels_primary_password_and_database():
    from shared.redis_connection import BadRedisUrl, sentinel_target

    target = sentinel_target("redis+sentinel://:pw%40x@10.0.0.1:26379,sentinel-b:26380,[::1]:26381/mymaster/2")
    assert target.sentinels == (("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381))
    assert (target.primary, target.password, target.db) == ("mymaster", "pw@x", 2)
    assert sentinel_target("redis://h:1/0") is None
    assert redacted("redis+sentinel://:s3cret@h:1,g:2/p/0") == "redis+sentinel://***@h:1,g:2/p/0"
    assert target.tls is None and target.tls_options() == {}
    tls = sentinel_target("rediss+sentinel://:pw@h:26380,g:26380/p/0?ssl_ca_certs=/etc/ca%20dir/ca.pem")
    assert (tls.sentinels, tls.primary, tls.password, tls.db) == ((("h", 26380), ("g", 26380)), "p", "pw", 0)
    assert tls.tls_options() == {"ssl": True, "ssl_ca_certs": "/etc/ca dir/ca.pem"}
    assert redacted("rediss+sentinel://:s3cret@h:1/p/0?ssl_ca_certs=x") == "rediss+sentinel://***@h:1/p/0?ssl_ca_certs=x"
    for bad in ("redis+sentinel://h:1", "redis+sentinel:///p", "redis+sentinel://h/p", "redis+sentinel://h:1/p/x",
                "redis+sentinel://h:1/p/0?ssl_ca_certs=x", "rediss+sentinel://h:1/p/0?nonsense=1"):
        with pytest.raises(BadRedisUrl):
            sentinel_target(bad)
        assert credentials_error(bad), bad  # said at start, not retried


def test_a_redis_that_fails_over_is_reached_through_its_sentinels_and_checked_at_start():
    """Through the Sentinels a client finds the primary; Sentinels that do not answer, or that know
    no such primary, are a clear error at start (not a retry loop)."""
    from tests.redis_server import RedisGroupProcess

    directory = tempfile.mkdtemp(prefix="iterserve-group-")
    group = RedisGroupProcess(directory, replicas=1).start()
    try:
        assert credentials_error(group.url) is None
        sentinels = ",".join(f"127.0.0.1:{port}" for port in group.group.sentinel_ports)
        assert "do not monitor a primary named 'other'" in credentials_error(f"redis+sentinel://{sentinels}/other")
        unanswered = credentials_error(f"redis+sentinel://127.0.0.1:{free_port()}/iterserve/0", timeout=0.5)
        assert unanswered and "no Sentinel" in unanswered
        started = time.monotonic()
        refused = subprocess.run(
            [sys.executable, "-m", "services.cli", "scheduler", "--redis-url",
             f"redis+sentinel://127.0.0.1:{free_port()}/iterserve"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "no Sentinel" in refused.stderr, refused.stderr
        assert time.monotonic() - started < 30, "a Sentinel that cannot be reached hangs the start"
    finally:
        group.stop(kill=True)
        shutil.rmtree(directory, ignore_errors=True)


def test_a_lost_primary_is_started_again_only_as_a_replica_of_the_one_promoted():
    """The launcher's rule for a lost primary: wait while the Sentinels still name it (they notice
    only after DOWN_AFTER_MS, and promote later: started as the primary before that, it has the
    group not fail over, or is promoted away under clients that reached it), then start it as a
    replica of the one promoted; as the primary only when none is promoted in
    PROMOTION_WAIT_SECONDS."""
    from services.redis_group import restart_under
    from tests.redis_server import RedisGroupProcess

    directory = tempfile.mkdtemp(prefix="iterserve-group-")
    group = RedisGroupProcess(directory, replicas=1).start()
    try:
        primary = group.group.primary_port
        assert group.kill_primary() == "redis"
        assert restart_under(group.group, "redis", 0.0) is None, "started again before a promotion"
        assert restart_under(group.group, "redis", 60.0) == primary  # none promoted in time: the primary
        assert restart_under(group.group, "replica-0", 0.0) == primary  # (a lost replica waits for nothing)
        deadline = time.monotonic() + 30
        while (port := restart_under(group.group, "redis", 0.0)) is None:
            assert time.monotonic() < deadline, "no promotion"
            time.sleep(0.1)
        assert port == group.group.replica_ports[0]
        # started again holding its old data: not promotable until it has synced
        assert group.group.server_command("redis-server", "redis", port, promotable=False)[-2:] == [
            "--replica-priority", "0"]
        group.restart_stopped()  # (returns once it is in sync and promotable)
        replica = redis.Redis(port=primary, socket_timeout=2)
        try:
            replication = replica.info("replication")
            assert replication["role"] == "slave" and replication["master_link_status"] == "up", replication
            assert replica.config_get("replica-priority") == {"replica-priority": "100"}
        finally:
            replica.close()
    finally:
        group.stop(kill=True)
        shutil.rmtree(directory, ignore_errors=True)


async def test_acceptance_waits_for_a_replica_and_counts_one_it_could_not_wait_for():
    """The gateway's submit returns once the replica holds the request (WAIT); with the replica gone
    it returns after redis_wait_ms, and says so."""
    from services.gateway.store import Store
    from shared import keys
    from shared.messages import RequestRecord, SamplingParams
    from tests.redis_server import RedisGroupProcess

    directory = tempfile.mkdtemp(prefix="iterserve-group-")
    group = RedisGroupProcess(directory, replicas=1).start()
    unreplicated = []
    # A generous wait first: a replica just synced, on a loaded machine, once took over 300 ms to
    # acknowledge its first write (CI); what is tested is that submit returns only once it holds it.
    store = Store(connect(group.url), wait_replicas=1, wait_ms=10_000, unreplicated=lambda: unreplicated.append(1))
    replica = redis.Redis(port=group.group.replica_ports[0], socket_timeout=5)
    try:
        record = RequestRecord(request_id="0" * 32, prompt_token_ids=(1, 2), sampling=SamplingParams(),
                               arrival_time=time.time())
        await store.submit(record)
        assert replica.hexists(keys.request_key(record.request_id), "record"), "returned before the replica held it"
        assert not unreplicated
        group.processes["replica-0"].kill()
        group.processes["replica-0"].wait(timeout=10)
        store.wait_ms = 300
        started = time.monotonic()
        await store.submit(record.model_copy(update={"request_id": "1" * 32}))
        assert 0.25 < time.monotonic() - started < 3 and unreplicated == [1]
    finally:
        replica.close()
        await store.redis.aclose()
        group.stop(kill=True)
        shutil.rmtree(directory, ignore_errors=True)
