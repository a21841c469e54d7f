"""Which of several schedulers takes a new request (services/scheduler/shards.py, CLAIM_SCRIPT), seen
through the whole system: two schedulers, each leasing one of two workers (emulated steps: the
choice is the scheduler's, and the workers' speed only sets the pace).
- Prefix-aware: a request whose prefix one scheduler's worker holds goes to that scheduler, so it
  finds its prefix cached (usage.prompt_tokens_details.cached_tokens), whichever scheduler reads it first.
- Fair across shards: one key flooding the queue does not make another key's requests wait behind
  the flood in Redis; the key served longest ago by either scheduler goes first.
The scripts themselves, against a real Redis: tests/test_shards.py."""

import concurrent.futures
import json
import signal
import time
import urllib.request

import pytest

from tests.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EMULATED = {"executor": "emulated", "hardware": "h100-qwen2.5-32b"}  # ~25 ms steps
KEY_A, KEY_B = "sk-shard-a-0123456789", "sk-shard-b-0123456789"


def completion(cluster: Cluster, prompt: str, max_tokens: int, key: str | None = None) -> dict:
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(f"{cluster.base_url}/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def each_scheduler_leases_one_worker(cluster: Cluster) -> None:
    def one_each() -> bool:
        schedulers = cluster.get_json("/status")[1]["models"]["smollm2-135m-instruct"]["schedulers"]
        return len(schedulers) == 2 and all(len(scheduler["leases"]) == 1 for scheduler in schedulers)
    until(one_each, "a worker leased by each scheduler")


DOCUMENTS = [" ".join(f"{topic} fact {index}: the {topic} record {index * 7 % 13} holds." for index in range(60))
             for topic in ("river", "glacier", "harbour", "orchard")]  # about 700 tokens each


def test_a_request_goes_to_the_scheduler_whose_worker_holds_its_prefix():
    with Cluster(**EMULATED, workers=2, schedulers=2) as cluster:
        each_scheduler_leases_one_worker(cluster)
        # Each document first runs on a scheduler of its own: the other is stopped (SIGSTOP, well
        # within its lease) until the first one has taken the request.
        for index, document in enumerate(DOCUMENTS):
            running, stopped = ("scheduler-1", "scheduler-2") if index % 2 == 0 else ("scheduler-2", "scheduler-1")
            seen = len(cluster.log_events(running, "admitted request_id="))
            cluster.kill(stopped, signal.SIGSTOP)
            try:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    first = pool.submit(completion, cluster, document + " Question 0?", 4)
                    until(lambda: len(cluster.log_events(running, "admitted request_id=")) > seen,
                          f"{running} to take it", 5)
            finally:
                cluster.kill(stopped, signal.SIGCONT)
            first.result()
        admitted = {name: len(cluster.log_events(name, "admitted request_id=")) for name in cluster.scheduler_names}
        assert admitted == {"scheduler-1": 2, "scheduler-2": 2}, admitted
        # Follow-ups sharing a document: each finds the document's KV where it ran, whichever
        # scheduler reads the new request first. (Taken by the other, a follow-up would find nothing
        # cached: a quarter of the time, both first follow-ups of a scheduler's two documents would
        # go its way by chance; all four, one time in sixteen.)
        cached = []
        for question in range(1, 4):
            for document in DOCUMENTS:
                usage = completion(cluster, document + f" Question {question}?", 4)["usage"]
                cached.append((usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
        missed = [(hit, total) for hit, total in cached if hit < total // 2]
        assert not missed, f"follow-ups that found less than half their prompt cached: {missed} of {cached}"
        admitted_total = len(cluster.log_events("scheduler", "admitted request_id="))
        assert admitted_total == len(DOCUMENTS) + len(cached), "a request was admitted twice (by both schedulers?)"


def test_one_key_flooding_the_queue_does_not_make_another_key_wait_behind_it_across_schedulers():
    """Each worker runs 2 requests at a time and each scheduler takes 4 more than that (then the
    rest wait in Redis, unowned): key A queues 24 requests, key B then sends 2. Taken oldest first,
    B's would wait behind the 12 of A's waiting in Redis; taken key by key, B's go at the next free place."""
    finished_at: dict[str, float] = {}
    with Cluster(**EMULATED, workers=2, schedulers=2, max_batch_size=2, api_keys=f"{KEY_A},{KEY_B}") as cluster:
        each_scheduler_leases_one_worker(cluster)

        def send(name: str, key: str) -> None:
            answer = completion(cluster, f"Request {name}: tell me about the sea.", 24, key)
            assert answer["usage"]["completion_tokens"] == 24, answer
            finished_at[name] = time.monotonic()

        with concurrent.futures.ThreadPoolExecutor(26) as pool:
            futures = [pool.submit(send, f"a{index}", KEY_A) for index in range(24)]
            until(lambda: cluster.get_json("/status")[1]["waiting"] >= 12, "key A's flood to queue", 10)
            futures += [pool.submit(send, f"b{index}", KEY_B) for index in range(2)]
            for future in futures:
                future.result()
    a_done = sorted(finished_at[f"a{index}"] for index in range(24))
    b_done = sorted(finished_at[f"b{index}"] for index in range(2))
    order = sorted(finished_at, key=finished_at.get)
    # (Taken oldest first, B's would be taken after the 12 of A's waiting in Redis, and finish after
    # about 16 of A's: each scheduler's own fair order puts them ahead of the 4 it holds waiting.)
    assert b_done[-1] < a_done[11], f"key B waited behind key A's flood: finish order {order}"
    print(f"figures: two-scheduler fairness finish order {order}")


def test_a_burst_of_requests_is_spread_over_both_schedulers_workers():
    """Twelve requests at once: the scheduler that reads them first takes its share, not all twelve
    (its one worker would run them while the other's idles)."""
    with Cluster(**EMULATED, workers=2, schedulers=2) as cluster:
        each_scheduler_leases_one_worker(cluster)
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda index: completion(cluster, f"Burst {index}: the sea.", 16), range(12)))
        assert all(answer["usage"]["completion_tokens"] == 16 for answer in answers), answers
        admitted = {name: len(cluster.log_events(name, "admitted request_id=")) for name in cluster.scheduler_names}
    assert sorted(admitted.values()) in ([6, 6], [5, 7]), f"a burst of 12 taken {admitted}"
    print(f"figures: a burst of 12 admitted {admitted}")
