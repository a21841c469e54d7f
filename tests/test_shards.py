"""Several schedulers per model, their leases and fences, on a real Redis (services/scheduler/shards.py,
RedisLink's WATCH). The system scenarios (a scheduler SIGKILLed or SIGSTOPped with real workers)
are in tests/test_chaos.py; the CLI's refusals at the end."""

import subprocess
from types import SimpleNamespace
import sys

import pytest

from services.scheduler.redis_link import LeaseLost, RedisLink
from services.scheduler.shards import NewRequestEntry, ShardMembership
from shared import keys, prefix_anchors

LEASE_MS = 2000
MODEL_KEYS = keys.SINGLE_MODEL


def link_of(redis_client, scheduler_id: str) -> RedisLink:
    return RedisLink(redis_client, on_write_failed=lambda write, error: None, scheduler_id=scheduler_id)


async def register_workers(redis_client, *worker_ids: str) -> None:
    for worker_id in worker_ids:
        await redis_client.sadd(MODEL_KEYS.workers, worker_id)
        await redis_client.set(keys.worker_heartbeat(worker_id), b"alive", px=60_000)


def new_requests(*request_ids: str, client_key: str = "",
                 tokens: tuple[int, ...] = ()) -> list[NewRequestEntry]:
    anchors = "".join(anchor.hex() for anchor in prefix_anchors.anchors(tokens))
    return [NewRequestEntry(request_id, client_key, len(tokens), anchors) for request_id in request_ids]


async def test_the_round_trip_of_a_scheduler_taken_over_writes_nothing(redis_client):
    link = link_of(redis_client, "a")
    await link.round_trip(block_ms=None)  # armed: the fence WATCHed on its connection
    link.queue("set", "written-before", "1")
    await link.round_trip(block_ms=None)
    assert await redis_client.get("written-before") == b"1"
    link.queue("set", "written-after", "1")
    link.queue("xadd", keys.plan_stream("w1"), {"m": b"plan"})
    await redis_client.set(MODEL_KEYS.scheduler_fence("a"), "taken")  # another scheduler took it over
    with pytest.raises(LeaseLost):
        await link.round_trip(block_ms=None)
    assert await redis_client.get("written-after") is None
    assert await redis_client.xlen(keys.plan_stream("w1")) == 0
    # A new connection (a reconnect loses the WATCH) reads the fence before it writes anything.
    await link.exchange.close()
    with pytest.raises(LeaseLost):
        await link.round_trip(block_ms=None)
    assert await redis_client.get("written-after") is None
    await link.exchange.close()


async def test_renewing_the_lease_does_not_fence_the_scheduler_itself(redis_client):
    link = link_of(redis_client, "a")
    shards = ShardMembership(link, "a", LEASE_MS)
    await shards.poll([])
    for round_trip in range(3):
        await link.round_trip(block_ms=None)
        await shards.poll([])  # (renews the lease from another connection, between two transactions)
        link.queue("set", f"write-{round_trip}", "1")
    await link.round_trip(block_ms=None)
    assert [await redis_client.get(f"write-{index}") for index in range(3)] == [b"1"] * 3
    await link.exchange.close()


async def test_workers_are_shared_out_and_a_dead_schedulers_workers_and_requests_are_taken_over(redis_client):
    a, b = (ShardMembership(link_of(redis_client, name), name, LEASE_MS) for name in ("a", "b"))
    await a.poll([])
    await b.poll([])
    await register_workers(redis_client, "w1", "w2", "w3")
    taken_a = (await a.poll([])).taken_workers
    taken_b = (await b.poll([])).taken_workers
    taken_a += (await a.poll(taken_a)).taken_workers
    assert (await a.poll(taken_a)).others_holding == 1
    assert (await b.poll(taken_b)).fewest_other == len(taken_a) and (await a.poll(taken_a)).fewest_other == len(taken_b)
    assert sorted(taken_a + taken_b) == ["w1", "w2", "w3"] and {len(taken_a), len(taken_b)} == {1, 2}
    run_id = (await a.poll(taken_a)).run_id
    for worker_id in taken_b:  # the value a worker's writes are checked against
        assert await redis_client.get(keys.worker_lease(worker_id)) == f"b {run_id}".encode()
    # b takes two requests; a request nobody took waits for whoever has room
    await redis_client.sadd(MODEL_KEYS.active_requests, "r1", "r2", "r3")
    taken, _ = await b.claim(new_requests("r1", "r2"), 8, 0.5, True)
    assert sorted(taken) == ["r1", "r2"]
    assert await a.claim(new_requests("r1"), 8, 0.5, True) == ([], ["r1"])  # b's: a forgets it
    # b dies: its lease runs out (deleted here, as the time to live would)
    await redis_client.delete(MODEL_KEYS.scheduler_lease("b"))
    poll = await a.poll(taken_a)
    assert poll.taken_over == ["b"] and poll.others_holding == 0 and poll.fewest_other == -1
    assert sorted(poll.claimed_requests) == ["r1", "r2"]
    assert sorted(poll.taken_workers) == sorted(taken_b)
    assert poll.fences[taken_b[0]] == 2  # its second owner: the fencing token grew
    assert await redis_client.get(MODEL_KEYS.scheduler_fence("b")) == b"taken"
    assert await redis_client.smembers(MODEL_KEYS.schedulers) == {b"a"}
    # b wakes: it finds itself taken over, and takes nothing
    with pytest.raises(LeaseLost):
        await b.poll(taken_b)
    with pytest.raises(LeaseLost):
        await b.claim(new_requests("r3"), 8, 0.5, True)
    assert await redis_client.hget(MODEL_KEYS.request_owners, "r3") is None
    assert (await a.poll(sorted(taken_a + taken_b))).unclaimed == 1  # r3 waits in Redis
    # r3, owned by nobody, waits for a scheduler with room
    assert (await a.poll(sorted(taken_a + taken_b), room=0)).claimed_requests == []
    assert (await a.poll(sorted(taken_a + taken_b), room=4)).claimed_requests == ["r3"]
    assert (await a.poll(sorted(taken_a + taken_b), room=4)).unclaimed == 0


async def test_a_worker_whose_lease_is_lost_is_reported(redis_client):
    a = ShardMembership(link_of(redis_client, "a"), "a", LEASE_MS)
    await a.poll([])
    await register_workers(redis_client, "w1")
    assert (await a.poll([])).taken_workers == ["w1"]
    await redis_client.set(keys.worker_lease("w1"), "someone-else x")
    assert (await a.poll(["w1"])).lost_workers == ["w1"]


async def test_a_dead_workers_lease_is_given_up_at_once_so_its_late_writes_are_refused(redis_client):
    """A worker whose heartbeat is gone (a host cut off) may come back within its lease's time and
    write what it computed meanwhile: its scheduler gives its lease up as it declares it dead, so the
    worker's WRITE_SCRIPT finds the lease gone (STALE), not its old scheduler's."""
    from services.scheduler.liveness import WorkerLiveness
    from services.scheduler.policy import SchedulerPolicy
    from services.worker.token_writer import STALE, WRITE_SCRIPT

    link = link_of(redis_client, "a")
    shards = ShardMembership(link, "a", 60_000)  # (a lease that would outlive the test)
    liveness = WorkerLiveness(link, SchedulerPolicy("a", context_length=256, stop_token_ids=()), stall_seconds=60,
                              shards=shards)
    await register_workers(redis_client, "w1", "w2")
    await liveness.poll()
    assert liveness.held == {"w1", "w2"}
    run_id = link.run_id
    assert await redis_client.get(keys.worker_lease("w1")) == f"a {run_id}".encode()

    def late_write(worker_id: str):
        return redis_client.eval(WRITE_SCRIPT, 2, MODEL_KEYS.results_of("a"), keys.worker_lease(worker_id),
                                 b"\x95\x90\x90\x90\x90\x90", b"result", 100, "a")

    assert await late_write("w1") != STALE  # (held: the write lands)
    await redis_client.delete(keys.worker_heartbeat("w1"))  # w1's host cut off: its heartbeat runs out
    await liveness.poll()
    assert liveness.held == {"w2"}
    assert await redis_client.get(keys.worker_lease("w1")) is None  # given up, not left to run out
    assert await late_write("w1") == STALE
    assert await redis_client.get(keys.worker_lease("w2")) == f"a {run_id}".encode()  # (another's stays)
    await link.exchange.close()


def test_the_gateway_sums_several_schedulers_and_counts_the_requests_none_took_as_waiting():
    from services.gateway.store import summed_schedulers
    from shared.messages import SchedulerInfo

    def info(scheduler_id: str, waiting: int, running: int, leases: dict[str, int]) -> SchedulerInfo:
        return SchedulerInfo(pid=1, policy="iteration", started_at=1.0, heartbeat_at=2.0, last_iteration_at=0.0,
                             iterations=10, waiting=waiting, running=running, scheduler_id=scheduler_id,
                             leases=leases, unclaimed=3, executors=["engine"])

    summed = summed_schedulers([info("a", 2, 5, {"w1": 1}), info("b", 1, 4, {"w2": 2})])
    assert (summed.waiting, summed.running, summed.iterations) == (2 + 1 + 3, 9, 20)
    assert summed.leases == {"w1": 1, "w2": 2} and summed.executors == ["engine"]


def test_a_redis_that_cannot_run_the_leases_scripts_is_refused_at_start():
    """EVAL renamed away (as an ACL denying it would): one line and exit 78, not a retry loop."""
    import os

    from tests.redis_server import RedisProcess

    server = RedisProcess(extra_args=("--rename-command", "EVAL", "")).start()
    try:
        done = subprocess.run([sys.executable, "-m", "services.cli", "scheduler", "--schedulers", "2"],
                              capture_output=True, text=True, timeout=120, env=os.environ | {"REDIS_URL": server.url})
    finally:
        server.stop(kill=True)
        server.close()  # (its data directory too)
    assert done.returncode == 78, (done.returncode, done.stderr[-1500:])
    assert "iterserve scheduler --schedulers 2: Redis refused the leases' script" in done.stderr, done.stderr[-1500:]


async def test_a_worker_lease_given_up_goes_to_the_scheduler_that_holds_the_fewest(redis_client):
    a, b = (ShardMembership(link_of(redis_client, name), name, LEASE_MS) for name in ("a", "b"))
    await a.poll([])
    await register_workers(redis_client, "w1", "w2")
    held_a = (await a.poll([])).taken_workers
    assert sorted(held_a) == ["w1", "w2"]  # alone: both
    assert (await b.poll([])).taken_workers == []  # joined later: none free
    poll = await a.poll(held_a)
    assert poll.fewest_other == 0  # two more than b: a hands one over
    run_id = poll.run_id
    await a.release_worker("w2", "wrong-run-id")  # (only its own lease is given up)
    assert await redis_client.get(keys.worker_lease("w2")) == f"a {run_id}".encode()
    await a.release_worker("w2", run_id)
    assert (await a.poll(["w1"])).taken_workers == []  # not taken back by the one that gave it up
    assert (await b.poll([])).taken_workers == ["w2"]


@pytest.mark.parametrize("arguments, message", [
    (["--schedulers", "0"], "schedulers"),
    (["--schedulers", "two"], "--schedulers"),
    (["--schedulers", "2", "--scheduler-cpus", "0"], "each scheduler gets its own CPUs"),
    (["--schedulers", "2", "--policy", "request"], "needs the iteration policy"),
])
def test_a_bad_schedulers_setting_is_refused_at_start(arguments, message):
    done = subprocess.run([sys.executable, "-m", "services.cli", "scheduler", *arguments], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, (done.returncode, done.stderr[-500:])


async def test_a_worker_runs_a_plan_only_under_its_schedulers_lease(redis_client):
    """services/worker/service.py Worker._under_lease, against a real Redis: a plan of one of several
    schedulers runs only while that scheduler holds the worker's lease (looked up when the epoch
    changes); a plan of the one scheduler (no `s-` epoch) needs none."""
    import msgpack

    from services.worker.service import Worker

    def plan(epoch: str) -> bytes:
        return msgpack.packb({"f": 5, "e": epoch, "p": 1, "w": "w1"})

    worker = SimpleNamespace(redis=redis_client, worker_id="w1", _leased_epoch=b"")
    under_lease = lambda data: Worker._under_lease(worker, data)  # noqa: E731
    assert await under_lease(plan("0123abcd"))  # the one scheduler's
    await redis_client.set(keys.worker_lease("w1"), "s-new runid")
    assert not await under_lease(plan("s-old"))  # taken over: its plans do not run
    assert await under_lease(plan("s-new"))
    await redis_client.set(keys.worker_lease("w1"), "s-other runid")
    assert await under_lease(plan("s-new"))  # (the same epoch: not looked up again)
    assert not await under_lease(plan("s-old"))


async def test_waiting_requests_are_taken_key_by_key_in_turn_across_schedulers(redis_client):
    """One key floods the queue: whichever scheduler has room next takes the key served longest ago
    by any of them (the turns live in Redis), not the oldest request."""
    a, b = (ShardMembership(link_of(redis_client, name), name, LEASE_MS) for name in ("a", "b"))
    await a.poll([])
    await b.poll([])
    flood = new_requests(*(f"f{index}" for index in range(6)), client_key="flood")
    quiet = new_requests("q1", client_key="quiet")
    taken, _ = await a.claim(flood + quiet, 2, 0.5, True)
    assert taken == ["f0", "q1"]  # one of each key, though q1 came last
    # a second request of the quiet key arrives behind the rest of the flood; b has room for one:
    # the flood's key was served longer ago (f0, before q1), so b takes f1 ...
    later = flood[1:] + new_requests("q2", client_key="quiet")
    taken, forget = await b.claim(later, 1, 0.5, True)
    assert (taken, forget) == (["f1"], [])
    # ... and then a, with room for one, takes q2 ahead of the four older flood requests
    taken, _ = await a.claim(later[1:], 1, 0.5, True)
    assert taken == ["q2"]
    taken, _ = await b.claim(later[1:], 8, 0.5, True)
    assert taken == ["f2", "f3", "f4", "f5"]  # (q2 is a's: b forgets it)


async def test_a_request_whose_prefix_another_schedulers_worker_holds_is_left_to_it_while_it_has_room(redis_client):
    a_link, b_link = link_of(redis_client, "a"), link_of(redis_client, "b")
    a, b = ShardMembership(a_link, "a", LEASE_MS), ShardMembership(b_link, "b", LEASE_MS)
    await a.poll([], room=8)
    await b.poll([], room=8)
    document = tuple(range(1000, 1000 + 600))  # a long shared prefix (600 tokens: 8 chunks' anchor)
    b.queue_anchors([document + (7, 8, 9)])  # b ran a request on it
    await b_link.round_trip(block_ms=None, read=False)
    follow_up = new_requests("r1", tokens=document + (1, 2, 3, 4, 5))
    assert await a.claim(follow_up, 8, 0.5, True) == ([], ["r1"])  # b's worker holds its prefix
    assert await b.claim(follow_up, 8, 0.5, True) == (["r1"], [])
    # not while b has no room, nor when the shared part is under the threshold, nor prefix-unaware
    await b.poll([], room=0)
    assert await a.claim(new_requests("r2", tokens=document + (6,)), 8, 0.5, True) == (["r2"], [])
    await b.poll([], room=8)
    short = new_requests("r3", tokens=document[:128] + tuple(range(5000, 5400)))  # 128 of 528 tokens shared
    assert await a.claim(short, 8, 0.5, True) == (["r3"], [])
    assert await a.claim(new_requests("r4", tokens=document), 8, 0.5, False) == (["r4"], [])
    assert await a.claim(new_requests("r5", tokens=document), 8, 0.5, True) == ([], ["r5"])
    # nor when b is gone: its anchors name a scheduler whose lease no longer holds
    await redis_client.delete(MODEL_KEYS.scheduler_lease("b"))
    assert await a.claim(new_requests("r6", tokens=document), 8, 0.5, True) == (["r6"], [])
    await a_link.exchange.close()
    await b_link.exchange.close()



async def test_a_burst_of_new_requests_is_spread_over_the_schedulers_as_their_room_allows(redis_client):
    """The first to read a burst does not take it all (its one worker would run it while the other
    scheduler's idles): each request goes to the scheduler with the most room, this one on a tie."""
    a_link, b_link = link_of(redis_client, "a"), link_of(redis_client, "b")
    a, b = ShardMembership(a_link, "a", LEASE_MS), ShardMembership(b_link, "b", LEASE_MS)
    await a.poll([], room=6)
    await b.poll([], room=6)
    burst = new_requests(*(f"r{index}" for index in range(6)))
    assert await a.claim(burst, 6, 0.5, True) == (["r0", "r2", "r4"], ["r1", "r3", "r5"])
    assert await b.claim(burst, 6, 0.5, True) == (["r1", "r3", "r5"], ["r0", "r2", "r4"])
    # more room takes more: a with 5 against b with 3 now (as b's take left it)
    more = new_requests(*(f"s{index}" for index in range(6)))
    assert await a.claim(more, 5, 0.5, True) == (["s0", "s1", "s2", "s4"], ["s3", "s5"])
    # nothing left to one without room, nor to one that is gone
    await b.poll([], room=0)
    assert await a.claim(new_requests("t0", "t1"), 8, 0.5, True) == (["t0", "t1"], [])
    await b.poll([], room=8)
    await redis_client.delete(MODEL_KEYS.scheduler_lease("b"))
    assert await a.claim(new_requests("u0", "u1"), 8, 0.5, True) == (["u0", "u1"], [])
    await a_link.exchange.close()
    await b_link.exchange.close()

def test_prefix_anchors_name_a_sequences_first_chunks_the_same_everywhere():
    tokens = list(range(3000, 3000 + 700))
    found = prefix_anchors.anchors(tokens)
    assert len(found) == 6  # 10 full chunks of 64: depths 1, 2, 3, 4, 6, 8
    assert prefix_anchors.anchors(tokens[:64 * 4]) == found[:4]  # a prefix's anchors begin a longer one's
    changed = tokens[:]
    changed[130] += 1  # in the third chunk: the anchors from there on differ, the first two do not
    assert prefix_anchors.anchors(changed)[:2] == found[:2]
    assert not set(prefix_anchors.anchors(changed)[2:]) & set(found)
    assert prefix_anchors.anchors(tokens[:63]) == []
    assert len(prefix_anchors.anchors(list(range(10_000)))) == len(prefix_anchors.DEPTHS)  # (4096 tokens at most)
    assert prefix_anchors.unpacked(prefix_anchors.packed(tokens)) == found
    assert prefix_anchors.unpacked(b"short") == []  # malformed: no hint
    entry = {b"id": b"r1", b"k": b"key", b"n": b"700", b"a": prefix_anchors.packed(tokens)}
    expected = NewRequestEntry("r1", "key", 700, "".join(anchor.hex() for anchor in found))
    assert NewRequestEntry.of_entry("r1", entry) == expected
    assert NewRequestEntry.of_entry("r1", {b"id": b"r1", b"n": b"many"}) == NewRequestEntry("r1")


async def test_a_poll_on_a_restarted_redis_writes_nothing_until_the_scheduler_joins_it_anew(redis_client):
    """A Redis restarted may have lost its last writes: a worker lease renewed on it with its new run_id
    would let that worker's writes of plans made before the restart land after the lost entries."""
    from services.scheduler.redis_link import RedisRestarted

    link = link_of(redis_client, "a")
    a = ShardMembership(link, "a", LEASE_MS)
    link.run_id = (await a.poll([])).run_id
    await register_workers(redis_client, "w1")
    assert (await a.poll([])).taken_workers == ["w1"]
    await redis_client.delete(keys.worker_lease("w1"))  # as the lost writes would have it
    link.run_id = "f" * 40  # (the server it joined: another one than this)
    with pytest.raises(RedisRestarted):
        await a.poll(["w1"])
    assert await redis_client.get(keys.worker_lease("w1")) is None
    await link.exchange.close()
