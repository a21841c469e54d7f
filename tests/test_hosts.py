"""A deployment whose services are hosts of their own (network namespaces: tests/netns_hosts.py):
Redis (password and TLS only, a primary, a replica and Sentinels), two gateways, two schedulers (--schedulers 2) and two workers of the
real model, each its own address from 198.18.0.0/15. Faults are links that go down and come back,
not processes killed: a worker host cut off mid-stream (its requests finish on the other worker, and
once its link is back its late results are refused), a scheduler host cut off (the other takes its
workers and requests; back, it finds itself taken over and writes nothing), a gateway host cut off
(clients re-attach through the other gateway from their last event), the Redis primary's host cut
off. Every output equals the same
request's fault-free run on this deployment, and every token stream in Redis has each token once.

Redis is a primary and a replica on two hosts with three Sentinels (on those two and a third), every
one TLS only (rediss+sentinel://): last, the primary's host is cut off mid-stream, the Sentinels
promote the replica, and nothing accepted is lost (the gateways accept once the replica holds a
request). Not here: latency between hosts (`tc netem`: this machine's kernel has no sch_netem)."""

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from shared import keys
from shared.redis_connection import sync_client
from tests.netns_hosts import Hosts, netns_available
from tests.test_chaos import (Output, check_same_as_baseline, longest_gap, mixed, session, stream_request,
                              token_events, until, whole_request)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
HOSTS = ["redis", "redis-2", "sentinel", "gateway-1", "gateway-2", "scheduler-1", "scheduler-2", "worker-1",
         "worker-2"]
SENTINEL_HOSTS = ("redis", "redis-2", "sentinel")  # a Sentinel on each (quorum 2)
PRIMARY = "iterserve"
PASSWORD = "hosts-pw"
PORT = 8000
WORKLOAD = mixed("hosts", 8, 0, 7000, lambda index: 32, ignore_eos=True)


class Deployment:
    """The hosts, what runs on each, and where a client reaches the gateways."""

    def __init__(self, hosts: Hosts, redis_url: str) -> None:
        self.hosts, self.redis_url = hosts, redis_url
        self.base_url = self.url_of("gateway-1")  # where clients go (and re-attach)

    def url_of(self, gateway: str) -> str:
        return f"http://{self.hosts.address(gateway)}:{PORT}"

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.base_url}/status", timeout=5) as response:
            import json
            return json.loads(response.read())

    def schedulers(self) -> list[dict]:
        return self.status()["models"]["smollm2-135m-instruct"]["schedulers"]

    def redis_client(self):
        return sync_client(self.redis_url, 10)


def certificate(directory: Path, addresses: list[str]) -> tuple[Path, Path]:
    """One self-signed certificate for every Redis and Sentinel host (each checks it as its CA)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    names = ",".join(f"IP:{address}" for address in addresses)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    f"/CN={addresses[0]}", "-addext", f"subjectAltName={names}", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def tls_options(cert: Path, key: Path) -> list[str]:
    return ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
            "--tls-auth-clients", "no", "--tls-replication", "yes"]


def start_redis_group(hosts: Hosts, directory: Path) -> str:
    """A primary (host redis), its replica (redis-2) and three Sentinels, every one TLS only with a
    password; the URL every service uses: through the Sentinels."""
    primary, replica = hosts.address("redis"), hosts.address("redis-2")
    cert, key = certificate(directory, [hosts.address(name) for name in SENTINEL_HOSTS])
    for name, extra in (("redis", []), ("redis-2", ["--replicaof", primary, "6380", "--masterauth", PASSWORD])):
        data = directory / name
        data.mkdir()
        hosts.run(name, ["redis-server", "--port", "0", "--tls-port", "6380", "--bind", hosts.address(name),
                         *tls_options(cert, key), "--requirepass", PASSWORD, "--appendonly", "yes", "--dir",
                         str(data), "--save", "", *extra], dict(os.environ), name)
    for name in SENTINEL_HOSTS:
        data = directory / f"sentinel-{name}"
        data.mkdir()
        others = "".join(f"sentinel known-sentinel {PRIMARY} {hosts.address(other)} 26380 {sentinel_id(other)}\n"
                         for other in SENTINEL_HOSTS if other != name)
        config = data / "sentinel.conf"
        config.write_text(
            f"port 0\ntls-port 26380\nbind {hosts.address(name)}\ndir {data}\n"
            f"tls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {cert}\ntls-auth-clients no\n"
            f"tls-replication yes\nsentinel myid {sentinel_id(name)}\n"
            f"sentinel monitor {PRIMARY} {primary} 6380 2\nsentinel auth-pass {PRIMARY} {PASSWORD}\n"
            f"sentinel down-after-milliseconds {PRIMARY} 1000\nsentinel failover-timeout {PRIMARY} 10000\n"
            f"sentinel parallel-syncs {PRIMARY} 1\nsentinel known-replica {PRIMARY} {replica} 6380\n{others}")
        hosts.run(name, ["redis-server", str(config), "--sentinel"], dict(os.environ), f"sentinel-{name}")
    sentinels = ",".join(f"{hosts.address(name)}:26380" for name in SENTINEL_HOSTS)
    return f"rediss+sentinel://:{PASSWORD}@{sentinels}/{PRIMARY}/0?ssl_ca_certs={cert}"


def sentinel_id(name: str) -> str:
    import hashlib
    return hashlib.sha1(f"hosts-sentinel-{name}".encode()).hexdigest()


def wait_for_group(url: str, hosts: Hosts, timeout: float = 30) -> None:
    """Until the primary answers through the Sentinels and its replica is in sync (else what each
    Redis and Sentinel process logged, and whether it is still running)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = sync_client(url, 2)
            try:
                replication = client.info("replication")
                if replication.get("role") == "master" and replication.get("connected_slaves") == 1:
                    return
            finally:
                client.close()
        except Exception as error:  # (not up yet: any of redis-py's errors)
            last = error
        else:
            last = replication
        assert time.monotonic() < deadline, f"the Redis group did not come up: {last}\n" + hosts.report(
            ["redis", "redis-2", *(f"sentinel-{name}" for name in SENTINEL_HOSTS)])
        time.sleep(0.3)


@pytest.fixture(scope="module")
def deployment():
    why_not = netns_available()
    if why_not:
        pytest.fail(f"this test makes hosts of network namespaces: {why_not}")
    if shutil.which("openssl") is None:
        pytest.fail("this test needs openssl (Redis's TLS certificate)")
    directory = Path(tempfile.mkdtemp(prefix="iterserve-hosts-"))
    try:
        with Hosts(HOSTS, directory) as hosts:
            url = start_redis_group(hosts, directory)
            wait_for_group(url, hosts)
            env = dict(os.environ) | {
                "REDIS_URL": url, "PYTHONUNBUFFERED": "1", "ITERSERVE_SCHEDULERS": "2", "ITERSERVE_DEVICE": "cpu",
                "ITERSERVE_REDIS_WAIT_REPLICAS": "1",
                "ITERSERVE_THREADS": "1", "ITERSERVE_KV_BLOCKS": "256", "ITERSERVE_LOG_LEVEL": "INFO",
                "ITERSERVE_LOG_REQUESTS": "1", "ITERSERVE_MAX_STREAMS_PER_KEY": "1024"}
            for name in ("scheduler-1", "scheduler-2"):
                hosts.run(name, [sys.executable, "-m", "services.cli", "scheduler"], env, name)
            for index, name in enumerate(("worker-1", "worker-2")):
                hosts.run(name, [sys.executable, "-m", "services.cli", "worker"],
                          env | {"ITERSERVE_WORKER_ID": f"host-w{index + 1}"}, name)
            for name in ("gateway-1", "gateway-2"):
                hosts.run(name, [sys.executable, "-m", "services.cli", "gateway", "--host", hosts.address(name),
                                 "--port", str(PORT)], env, name)
            system = Deployment(hosts, url)
            deadline = time.monotonic() + 180
            while True:
                try:
                    if sorted(len(scheduler["leases"]) for scheduler in system.schedulers()) == [1, 1]:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "\n".join(f"--- {name}\n{hosts.log(name)[-1500:]}"
                                                              for name in HOSTS)
                time.sleep(0.3)
            yield system
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        left = [line for line in (links + namespaces).splitlines()
                if hosts.bridge in line or any(end in line for end in hosts.host_ends.values())
                or any(namespace in line for namespace in hosts.namespaces.values())]
        assert not left, f"left behind: {left}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def baseline(deployment: Deployment) -> dict[str, Output]:
    async def run() -> dict[str, Output]:
        outputs = {spec.name: Output() for spec in WORKLOAD}
        async with session() as http:
            await asyncio.gather(*[whole_request(http, deployment, spec, outputs[spec.name]) for spec in WORKLOAD])
        return outputs
    return asyncio.run(run())


def reading_session() -> aiohttp.ClientSession:
    """A client that gives a silent stream up after 5 s (a cut link sends no FIN: without it, the
    read would wait forever) and then re-attaches."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=180, sock_connect=5, sock_read=5))


def run_with(deployment: Deployment, fault, reattach: bool = False, patient: bool = False) -> dict[str, Output]:
    """patient: the clients wait on a silent stream (a gateway holds its streams open while Redis
    does not answer, up to 30 s)."""
    async def run() -> dict[str, Output]:
        outputs = {spec.name: Output() for spec in WORKLOAD}
        async with (session() if patient else reading_session()) as http:
            async with asyncio.timeout(180):
                await asyncio.gather(fault(outputs), *[stream_request(http, deployment, spec, outputs[spec.name],
                                                                      reattach) for spec in WORKLOAD])
        return outputs
    return asyncio.run(run())


def check_streams(deployment: Deployment, outputs: dict[str, Output]) -> None:
    for name, output in outputs.items():
        events = token_events(deployment, output.request_id)
        tokens = [event for event in events if event.token_id >= 0]
        assert [event.index for event in tokens] == list(range(len(tokens))), f"{name}: gap or duplicate"
        assert events[-1].finish_reason and len(tokens) == output.completion_tokens


def owner_of(deployment: Deployment, worker_id: str) -> str:
    """The scheduler host holding that worker (its process's pid, in /status, named by our processes)."""
    pid = next(scheduler["pid"] for scheduler in deployment.schedulers() if worker_id in scheduler["leases"])
    return next(name for name, process, _, _ in deployment.hosts.processes if process.pid == pid)


def test_a_worker_host_cut_off_mid_stream_its_requests_finish_on_the_other_and_its_late_results_are_refused(
        deployment, baseline):
    chosen: list[tuple[str, str, str]] = []  # (worker host, worker id, its scheduler's host)

    async def fault(outputs: dict[str, Output]) -> None:
        await until(lambda: all(len(output.pieces) >= 6 for output in outputs.values()), "6 tokens in every stream")
        # the worker running the most (its heartbeat's count, up to 0.5 s old)
        busiest = max(deployment.status()["workers"], key=lambda worker: worker["running"])
        assert busiest["running"] > 0
        worker_id = busiest["id"]
        chosen.append((f"worker-{worker_id.removeprefix('host-w')}", worker_id, owner_of(deployment, worker_id)))
        deployment.hosts.cut(chosen[0][0])
        await until(lambda: all(output.finish_reason for output in outputs.values()), "every request's end", 120)

    outputs = run_with(deployment, fault)
    host, worker_id, owner = chosen[0]
    check_same_as_baseline(outputs, baseline, "with a worker host cut off")
    check_streams(deployment, outputs)
    assert f"worker_dead worker_id={worker_id}" in deployment.hosts.log(owner)
    print(f"hosts: {host} cut off, longest stream gap {longest_gap(outputs):.2f} s")
    assert longest_gap(outputs) < 10.0
    owner_before = len(deployment.hosts.log(owner))
    deployment.hosts.restore(host)
    restored = time.monotonic()

    def refused() -> str:
        """Where the late result was refused: by the lease (another scheduler holds the worker now;
        or a plan of the old lease, not run), or, where its scheduler took the worker back first (it
        held none: its lease, its epoch again), by that scheduler (an answer to a plan it gave up)."""
        worker_log, owner_log = deployment.hosts.log(host), deployment.hosts.log(owner)[owner_before:]
        for event in ("event=stale_write", "event=plan_without_lease"):
            if event in worker_log:
                return event
        return "stale_result" if f"stale_result worker_id={worker_id}" in owner_log else ""

    try:
        asyncio.run(until(refused, "the cut-off worker's late result refused once its link is back", 30))
    except AssertionError as error:
        raise AssertionError(f"{error}\n" + deployment.hosts.report([host, owner])) from None
    print(f"hosts: {host}'s late result refused ({refused()}) {time.monotonic() - restored:.1f} s after its link "
          "is back")
    # back: a worker again, leased by a scheduler (one each, once any handover is done)
    asyncio.run(until(lambda: sorted(len(scheduler["leases"]) for scheduler in deployment.schedulers()) == [1, 1],
                      "the worker back in a shard", 30))
    check_streams(deployment, outputs)  # (and nothing the late result carried was added to them)


def test_a_scheduler_host_cut_off_is_taken_over_and_once_back_writes_nothing(deployment, baseline):
    times: dict[str, float] = {}
    chosen: list[str] = []

    async def fault(outputs: dict[str, Output]) -> None:
        await until(lambda: all(len(output.pieces) >= 6 for output in outputs.values()), "6 tokens in every stream")
        busiest = max(deployment.schedulers(), key=lambda scheduler: scheduler["running"])  # (heartbeat: 0.5 s old)
        assert busiest["running"] > 0
        chosen.append(next(name for name, process, _, _ in deployment.hosts.processes if process.pid == busiest["pid"]))
        deployment.hosts.cut(chosen[0])
        times["cut"] = time.time()
        await until(lambda: all(output.finish_reason for output in outputs.values()), "every request's end", 120)

    outputs = run_with(deployment, fault)
    cut = chosen[0]
    check_same_as_baseline(outputs, baseline, "with a scheduler host cut off")
    check_streams(deployment, outputs)
    print(f"hosts: {cut} cut off, longest stream gap {longest_gap(outputs):.2f} s")
    assert longest_gap(outputs) < 5.0, longest_gap(outputs)
    other = "scheduler-2" if cut == "scheduler-1" else "scheduler-1"
    assert "scheduler_taken_over" in deployment.hosts.log(other)
    deployment.hosts.restore(cut)
    asyncio.run(until(lambda: "lease_lost scheduler_id" in deployment.hosts.log(cut),
                      "the cut-off scheduler finding it was taken over", 30))
    time.sleep(1.0)  # (what it had queued would be sent now)
    check_streams(deployment, outputs)  # nothing it wrote after it was taken over: each token once


def test_a_gateway_host_cut_off_its_clients_reattach_through_the_other(deployment, baseline):
    deployment.base_url = deployment.url_of("gateway-1")

    async def fault(outputs: dict[str, Output]) -> None:
        await until(lambda: all(len(output.pieces) >= 6 for output in outputs.values()), "6 tokens in every stream")
        deployment.hosts.cut("gateway-1")
        deployment.base_url = deployment.url_of("gateway-2")  # (re-attaches go there)

    try:
        outputs = run_with(deployment, fault, reattach=True)
    finally:
        deployment.hosts.restore("gateway-1")
    check_same_as_baseline(outputs, baseline, "through a gateway host cut off")
    assert all(output.reattached for output in outputs.values())
    print(f"hosts: gateway-1 cut off, longest stream gap {longest_gap(outputs):.2f} s (5 s of it the client's "
          f"read timeout)")
    check_streams(deployment, outputs)


def test_the_redis_primary_host_cut_off_sentinel_promotes_and_nothing_accepted_is_lost(deployment, baseline):
    times: dict[str, float] = {}

    async def fault(outputs: dict[str, Output]) -> None:
        await until(lambda: all(len(output.pieces) >= 6 for output in outputs.values()), "6 tokens in every stream")
        deployment.hosts.cut("redis")  # its Sentinel goes with it: the other two are the quorum
        times["cut"] = time.monotonic()

    try:
        outputs = run_with(deployment, fault, patient=True)
    except BaseException:
        for name in ("scheduler-1", "scheduler-2", "gateway-1", "worker-1", "worker-2", "sentinel-sentinel"):
            print(f"--- {name}\n{deployment.hosts.log(name)[-2500:]}")
        raise
    check_same_as_baseline(outputs, baseline, "with the Redis primary's host cut off")
    check_streams(deployment, outputs)
    client = deployment.redis_client()
    try:
        assert client.info("replication")["role"] == "master"
        assert client.connection_pool.get_master_address()[0] == deployment.hosts.address("redis-2")
    finally:
        client.close()
    # (promoted 2-3 s after the cut; each service's connections to the lost host given up after about
    # 5 s of silence, shared/redis_connection.py KEEPALIVE_OPTIONS; then the schedulers load again)
    print(f"hosts: the Redis primary cut off, longest stream gap {longest_gap(outputs):.2f} s")
    assert longest_gap(outputs) < 30.0


def test_nothing_is_left_active(deployment):
    client = deployment.redis_client()
    try:
        assert not client.smembers(keys.ACTIVE_REQUESTS_SET)
    finally:
        client.close()
