"""REDIS_URL with a password and over TLS (rediss://), as every service connects
(shared/redis_connection.py). The whole system on a password-protected Redis is in
tests/test_admission_system.py."""

import shutil
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
