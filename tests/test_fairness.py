"""Fair admission across client keys (services/scheduler/policy.py, SchedulerPolicy._fair_order):
round-robin across keys, FCFS within a key, without Redis. The system-level test with two keys
is in tests/test_admission_system.py."""

from services.bench.by_request_id import apply_result
from services.scheduler.policy import SchedulerPolicy
from shared.messages import RequestRecord, SamplingParams
from tests.test_scheduler_policy import FakeWorker, drive, make_policy


def keyed(request_id: str, client_key: str, arrival: float, prompt_len: int = 4, max_tokens: int = 3) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        prompt_token_ids=tuple(range(100, 100 + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival,
        client_key=client_key,
    )


def admission_order(policy: SchedulerPolicy, records: list[RequestRecord]) -> list[str]:
    """Run everything on one worker; the order in which requests joined a batch."""
    prompts = {record.request_id: record.prompt_token_ids for record in records}
    for record in records:
        policy.add_request(record)
    _, reasons, plans = drive(policy, {"w1": FakeWorker(prompts)})
    assert set(reasons) == set(prompts), "every request finishes"
    return [new.request_id for plan in plans for new in plan.new_requests]


def test_a_flooding_key_gets_one_turn_per_round_and_the_other_key_is_not_starved():
    policy = make_policy(max_batch_size=1)  # one request at a time: the queue order is the service order
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    flood = [keyed(f"a{index}", "key-a", arrival=index) for index in range(8)]
    late = [keyed(f"b{index}", "key-b", arrival=10 + index) for index in range(2)]  # after the whole flood
    order = admission_order(policy, flood + late)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5", "a6", "a7"], order


def test_with_one_key_or_none_the_order_is_plain_fcfs():
    for client_key in ("", "key-a"):
        policy = make_policy(max_batch_size=1)
        policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
        records = [keyed(f"r{index}", client_key, arrival=arrival) for index, arrival in enumerate([3, 1, 2, 0])]
        assert admission_order(policy, records) == ["r3", "r1", "r2", "r0"]


def test_one_batch_interleaves_three_keys_fcfs_within_each():
    policy = make_policy(max_batch_size=64, max_batch_tokens=512)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    records = [keyed("a0", "key-a", 0), keyed("a1", "key-a", 1), keyed("a2", "key-a", 2), keyed("a3", "key-a", 3),
               keyed("b0", "key-b", 4), keyed("b1", "key-b", 5), keyed("c0", "key-c", 6)]  # fmt: skip
    for record in records:
        policy.add_request(record)
    plan = policy.next_plan("w1")
    assert [item.request_id for item in plan.items] == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_a_key_back_from_idle_is_not_punished_for_what_it_was_served_before():
    policy = make_policy(max_batch_size=1)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    records = [keyed(f"b{index}", "key-b", arrival=index) for index in range(3)]
    records += [keyed(f"a{index}", "key-a", arrival=3 + index) for index in range(6)]
    prompts = {record.request_id: record.prompt_token_ids for record in records}
    for record in records:
        policy.add_request(record)
    worker, joined = FakeWorker(prompts), []
    while policy.waiting_count + policy.running_count:
        plan = policy.next_plan("w1")
        joined += [new.request_id for new in plan.new_requests]
        apply_result(policy, worker.run(plan))
        if joined[-1:] == ["a3"] and "b3" not in prompts:  # key-b, idle since b2, sends again
            late = keyed("b3", "key-b", arrival=20)
            prompts["b3"] = late.prompt_token_ids
            policy.add_request(late)
    assert joined == ["b0", "a0", "b1", "a1", "b2", "a2", "a3", "b3", "a4", "a5"], joined


def test_a_preempted_request_keeps_its_place_within_its_key():
    policy = make_policy(max_batch_size=4, max_batch_tokens=512)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    for record in [keyed("a0", "key-a", 0), keyed("a1", "key-a", 1), keyed("b0", "key-b", 2)]:
        policy.add_request(record)
    plan = policy.next_plan("w1")
    assert [item.request_id for item in plan.items] == ["a0", "b0", "a1"]
    policy.worker_down("w1")  # everything waits again, each at its FCFS place within its key
    policy.worker_up("w2", kv_blocks_total=100, kv_block_size=4)
    plan = policy.next_plan("w2")
    # key-b was served longest ago (b0 joined before a1), so its turn comes first; a0 stays before a1.
    assert [item.request_id for item in plan.items] == ["b0", "a0", "a1"]
    assert policy.waiting_tokens == 0
    policy.add_request(keyed("c0", "key-c", 3, prompt_len=7))
    assert policy.waiting_tokens == 7
