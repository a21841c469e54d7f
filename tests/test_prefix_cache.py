"""Prefix caching: the worker's cache of full KV blocks (refcounts, LRU eviction), the scheduler's
exact copy of it, and outputs that do not change when a prefix comes from the cache.

The scheduler decides every change to a worker's cache and names it in its plans; these tests drive
the real SchedulerPolicy and real executors (the engine on a tiny random model, and the emulated
executor, whose block accounting is the engine's) in one process, plan by plan."""

import random

import pytest
import torch

from services.scheduler.policy import SchedulerPolicy
from services.scheduler.prefix_cache import extend_chain, root_hash
from services.worker.emulated import EmulatedEngine, emulated_tokens
from services.worker.hardware import load_profile
from services.worker.kv_cache import BlockTables, CacheMismatch
from services.bench.by_request_id import apply_result, plan_result
from shared import cache_digest
from shared.messages import BatchPlan, NewRequest, RequestRecord, SamplingParams
from tests.engine_helpers import TINY_CONFIG, cached_hashes, generate_alone, prefill_item, tiny_engine
from tests.requirements import import_or_skip

BLOCK = 4


def emulated(kv_blocks: int, block_size: int = BLOCK) -> EmulatedEngine:
    return EmulatedEngine(load_profile("h100-llama3-8b"), kv_blocks, block_size, 16, TINY_CONFIG.vocab_size,
                          TINY_CONFIG.context_length, sleep=lambda seconds: None)


def make_executor(kind: str, kv_blocks: int, block_size: int = BLOCK):
    return emulated(kv_blocks, block_size) if kind == "emulated" else tiny_engine(
        kv_blocks=kv_blocks, kv_block_size=block_size, max_batch_size=16)


def expected_output(kind: str, state) -> list[int]:
    """What a request that ran to its length gives alone on an empty cache: the tiny model's greedy
    tokens, or the emulated executor's tokens of its seed and prompt."""
    if kind == "emulated":
        return emulated_tokens(state.sampling.seed, state.prompt_token_ids, state.sampling.max_tokens,
                               TINY_CONFIG.vocab_size)
    return generate_alone(tiny_engine(kv_blocks=64, kv_block_size=BLOCK), state.request_id,
                          list(state.prompt_token_ids), state.sampling.max_tokens)


class Cluster:
    """A SchedulerPolicy and executors as its workers, in one process. Plans are pipelined as the
    service pipelines them: planned while the one before is still to run. Each worker checks, as
    it takes a plan, that its cache equals the scheduler's copy at the moment the plan was made."""

    def __init__(self, executors: dict, pipeline_depth: int = 2, **options):
        self.executors = executors
        options = {"max_batch_size": 8, "max_batch_tokens": 24, "prefix_caching": True} | options
        self.policy = SchedulerPolicy("epoch", context_length=TINY_CONFIG.context_length, stop_token_ids=(),
                                      pipeline_depth=pipeline_depth, **options)
        self.queued: dict[str, list[tuple[BatchPlan, dict]]] = {worker_id: [] for worker_id in executors}
        self.states = {}
        self.plans: list[BatchPlan] = []
        for worker_id, executor in executors.items():
            self.policy.worker_up(worker_id, executor.kv_cache.blocks_total, executor.kv_cache.block_size)
        self.arrivals = 0
        self.check_copies = True  # (the test of the service's own check turns this one off)

    def add(self, request_id: str, prompt, max_tokens: int, **sampling) -> None:
        self.arrivals += 1
        self.states[request_id] = self.policy.add_request(RequestRecord(
            request_id=request_id, prompt_token_ids=tuple(prompt), arrival_time=float(self.arrivals),
            sampling=SamplingParams(max_tokens=max_tokens, seed=self.arrivals, ignore_eos=True, **sampling)))

    def plan(self, worker_id: str) -> None:
        while (plan := self.policy.next_plan(worker_id)) is not None:
            copy = dict(self.policy.worker(worker_id).cache.references)
            self.queued[worker_id].append((plan, copy))
            self.plans.append(plan)

    def run_one(self, worker_id: str) -> bool:
        """The worker runs its oldest plan and answers it; False when it had none."""
        if not self.queued[worker_id]:
            return False
        plan, copy = self.queued[worker_id].pop(0)
        executor = self.executors[worker_id]
        if plan.free_all:
            executor.reset()
        executor.take_plan(plan)
        if self.check_copies:
            assert cached_hashes(executor.kv_cache) == copy, f"worker {worker_id}, plan {plan.plan_id}"
        outcome = executor.step(plan.items)
        apply_result(self.policy, plan_result(plan, outcome, worker_id, executor.kv_cache))
        self.policy.take_finished_without_token()
        self.policy.take_iteration_records()
        return True

    def tick(self) -> bool:
        busy = False
        for worker_id in self.executors:
            self.plan(worker_id)
            busy |= self.run_one(worker_id)
        return busy

    def drain(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.tick() and not self.policy.running_count and not self.policy.waiting_count:
                return
        raise AssertionError("the cluster did not drain")

    def kill(self, worker_id: str) -> None:
        """The worker dies and a fresh one takes its name (an empty cache)."""
        self.policy.worker_down(worker_id)
        self.queued[worker_id].clear()
        self.executors[worker_id].reset()
        kv = self.executors[worker_id].kv_cache
        self.policy.worker_up(worker_id, kv.blocks_total, kv.block_size)

    def output(self, request_id: str) -> list[int]:
        return self.states[request_id].output_token_ids

    def assert_nothing_held(self) -> None:
        """Every reference returned: no block in use on either side, the cached ones the same."""
        counts = self.policy.kv_blocks_by_worker()
        for worker_id, executor in self.executors.items():
            kv = executor.kv_cache
            assert executor.running == 0
            assert counts[worker_id]["in_use"] == 0
            assert (counts[worker_id]["cached"], counts[worker_id]["free"]) == (kv.blocks_cached, kv.blocks_free)
            assert kv.blocks_cached + kv.blocks_free == kv.blocks_total
            assert type(kv.blocks_cached) is int  # it goes on the wire as it is
            assert set(cached_hashes(kv).values()) <= {0}


# The worker's side: refcounts, idle blocks, commands that do not fit


def test_block_tables_share_registered_blocks_keep_them_idle_and_refuse_commands_that_do_not_fit():
    tables = BlockTables(num_blocks=6, block_size=2, max_rows=3, max_blocks_per_row=4)
    tables.grow(0, 5)
    tables.lengths[0] = 5  # 2 full blocks and a partial one
    tables.register(0, 0, b"a" * 16)
    tables.register(0, 1, b"b" * 16)
    with pytest.raises(CacheMismatch):
        tables.register(0, 2, b"c" * 16)  # not full
    with pytest.raises(CacheMismatch):
        tables.register(0, 1, b"d" * 16)  # registered already
    tables.adopt(1, [b"a" * 16, b"b" * 16])
    assert tables.lengths[1] == 4 and list(tables.block_table(1)) == list(tables.block_table(0)[:2])
    assert cached_hashes(tables) == {b"a" * 16: 2, b"b" * 16: 2}
    tables.free(0)  # its own third block returns to the pool; the shared two stay held by row 1
    assert (tables.blocks_free, tables.blocks_cached) == (4, 0)
    with pytest.raises(CacheMismatch):
        tables.evict([b"a" * 16])  # in use
    tables.free(1)
    assert (tables.blocks_free, tables.blocks_cached) == (4, 2)
    with pytest.raises(CacheMismatch):
        tables.adopt(2, [b"a" * 16, b"z" * 16])  # not all cached: nothing changes
    assert tables.blocks_held[2] == 0 and cached_hashes(tables) == {b"a" * 16: 0, b"b" * 16: 0}
    tables.evict([b"b" * 16])
    assert (tables.blocks_free, tables.blocks_cached) == (5, 1)
    tables.free_all()
    assert (tables.blocks_free, tables.blocks_cached, cached_hashes(tables)) == (6, 0, {})


def test_a_plan_whose_cache_commands_do_not_fit_is_refused_by_the_executor():
    executor = emulated(kv_blocks=8)
    plan = BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w", new_requests=(
        NewRequest(request_id="a", sampling=SamplingParams(), cached_blocks=(b"x" * 16,)),))
    with pytest.raises(CacheMismatch):
        executor.take_plan(plan)


# The scheduler's copy against the workers' caches


@pytest.mark.parametrize("kind", ["emulated", "engine"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_schedulers_copy_equals_every_workers_cache_through_a_random_history(kind, seed):
    """Requests sharing a few prefixes arrive, are cancelled at random, preempted (a small pool),
    their cached blocks evicted, a worker dies; at every plan each worker's cache equals the
    scheduler's copy, and at the end every reference is back (nothing in use, the rest cached or
    free, counted alike on both sides). Every request that ran to its end has the tokens it has
    alone (the emulated executor's depend on what its KV blocks hold, as the model's do)."""
    rng = random.Random(seed)
    cluster = Cluster({"w0": make_executor(kind, 24), "w1": make_executor(kind, 24)},
                      placement=rng.choice(["cache-aware", "least-loaded"]), placement_slack=2)
    vocab = TINY_CONFIG.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(4, 13))] for _ in range(3)]
    cancelled = set()
    for step in range(160):
        if rng.random() < 0.35:
            prompt = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            cluster.add(f"r{step}", prompt, rng.randint(1, 10))
        active = [request_id for request_id, state in cluster.states.items() if state.is_active]
        if active and rng.random() < 0.08:
            victim = rng.choice(active)
            cluster.policy.cancel(victim)
            cancelled.add(victim)
        if step == 80:
            cluster.kill("w1")
        cluster.tick()
    cluster.drain()
    cluster.assert_nothing_held()
    assert cluster.policy.prefix_cache_hit_tokens > 0, "no request found its prefix cached"
    assert any(plan.evict_blocks for plan in cluster.plans), "the pool never had to evict"
    for request_id, state in cluster.states.items():
        if request_id not in cancelled and state.finish_reason == "length":
            assert state.output_token_ids == expected_output(kind, state), request_id


@pytest.mark.parametrize("kind", ["emulated", "engine"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_workers_of_different_block_sizes_never_take_each_others_names_for_kv(kind, seed):
    """Two workers of one model with block sizes 4 and 8: a request's block hashes are computed per
    kind of worker cache (the block size is in their root), so a request placed on one worker, its
    prefix looked up on both, or moved between them when a worker dies never adopts a block that
    holds other tokens than its own. Every request that runs to its end has its greedy tokens alone.
    (With one chain per request extended at whichever block size came first, a request sharing 4
    tokens with another adopted its 8-token block: seeds 0 and 2 failed, on both executors.)"""
    rng = random.Random(seed)
    cluster = Cluster({"w4": make_executor(kind, 40, block_size=4), "w8": make_executor(kind, 20, block_size=8)},
                      placement="cache-aware", placement_threshold=0.0, placement_slack=3)
    assert cluster.policy.worker("w4").cache_root != cluster.policy.worker("w8").cache_root
    vocab = TINY_CONFIG.vocab_size
    stems = [[rng.randrange(vocab) for _ in range(4)] for _ in range(2)]
    prefixes = [stem + [rng.randrange(vocab) for _ in range(rng.choice((4, 8, 12)))] for stem in stems for _ in range(3)]
    for step in range(120):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            cluster.add(f"r{step}", prompt, rng.randint(1, 8))
        if step in (40, 80):
            cluster.kill(rng.choice(["w4", "w8"]))
        cluster.tick()
    cluster.drain()
    cluster.assert_nothing_held()
    assert cluster.policy.prefix_cache_hit_tokens > 0, "no request found its prefix cached"
    for request_id, state in cluster.states.items():
        assert state.finish_reason == "length"
        assert state.output_token_ids == expected_output(kind, state), request_id


@pytest.mark.parametrize("kind", ["emulated", "engine"])
def test_a_worker_cache_that_drifts_from_the_schedulers_copy_is_caught_and_started_over(kind, caplog):
    """Every result carries the worker's prefix-cache digest (shared/cache_digest.py), checked against
    the scheduler's copy as of the plan it answers. A divergence that every command still fits (here
    an extra block registered behind the scheduler's back, then one of the copy's hashes lost) is
    logged, counted, and that worker's cache starts over; every output stays what it is alone."""
    cluster = Cluster({"w": make_executor(kind, 40)}, pipeline_depth=2)
    cluster.check_copies = False
    executor = cluster.executors["w"]
    shared = list(range(40, 52))
    cluster.add("a", shared + [1], 6)
    cluster.drain()
    assert cluster.policy.prefix_cache_mismatches == 0 and len(cluster.policy.worker("w").cache) == 4
    # The worker holds a block the scheduler never named (a command lost, say): every later command fits.
    executor.add_request("stray", SamplingParams(max_tokens=1))
    executor.step([prefill_item("stray", [9] * BLOCK, sample=False)])
    executor.kv_cache.register(executor.row("stray"), 0, b"s" * 16)
    executor.free("stray")
    cluster.add("b", shared + [2], 6)
    with caplog.at_level("ERROR", logger="iterserve.scheduler"):
        cluster.drain()
    assert cluster.policy.prefix_cache_mismatches == 1
    assert "prefix_cache_digest_mismatch worker_id=w" in caplog.text
    assert b"s" * 16 not in cached_hashes(executor.kv_cache), "the worker's cache was not started over"
    # The scheduler's copy loses a hash (a bookkeeping bug): caught the same way.
    copy = cluster.policy.worker("w").cache
    lost = next(iter(copy.idle))
    del copy.references[lost], copy.idle[lost]
    copy.digest = cache_digest.removed(copy.digest, lost)
    cluster.policy.worker("w").kv_blocks_reserved += 1  # (the block is still the worker's: counted as used)
    cluster.add("c", shared + [3], 6)
    cluster.drain()
    assert cluster.policy.prefix_cache_mismatches == 2
    for request_id in ("a", "b", "c"):
        assert cluster.output(request_id) == expected_output(kind, cluster.states[request_id]), request_id
    cluster.policy.worker("w").kv_blocks_reserved -= 1
    cluster.assert_nothing_held()


def test_shared_blocks_outlive_a_cancelled_request_and_are_evicted_least_recently_used_first():
    """a and b share a two-block prefix; a is cancelled mid-decode, b finishes exactly as alone;
    then every block is cached and idle, and a pool-filling request evicts them oldest first."""
    engine = tiny_engine(kv_blocks=12, kv_block_size=BLOCK, max_batch_size=16)
    cluster = Cluster({"w": engine}, pipeline_depth=1)
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]
    cluster.add("a", prefix + [1, 2], max_tokens=20)
    for _ in range(3):
        cluster.tick()
    cluster.add("b", prefix + [3], max_tokens=6)
    for _ in range(2):
        cluster.tick()
    worker = cluster.policy.worker("w")
    chain = cluster.states["b"].block_chain(worker.cache_root)[:2]
    assert cluster.states["b"].adopted_blocks == 2 and [worker.cache.references[h] for h in chain] == [2, 2]
    cluster.policy.cancel("a")
    cluster.tick()
    assert [worker.cache.references[h] for h in chain] == [1, 1], "a's references returned at once"
    assert cached_hashes(engine.kv_cache)[chain[0]] == 1
    cluster.drain()
    assert cluster.output("b") == generate_alone(tiny_engine(kv_blocks=12, kv_block_size=BLOCK), "b", prefix + [3], 6)
    cluster.assert_nothing_held()
    idle_order = list(worker.cache.idle)  # least recently used first
    a_only = [h for h in idle_order if h not in cluster.states["b"].block_chain(worker.cache_root)]
    assert idle_order[: len(a_only)] == a_only, "a's own blocks (released first) are the oldest"
    cached = engine.kv_cache.blocks_cached
    assert cached >= 4
    # A request needing every block of the pool but one evicts all but one cached block, oldest first.
    cluster.add("big", [200 + index % 50 for index in range(BLOCK * 11)], max_tokens=1)
    cluster.tick()
    evicted = [h for plan in cluster.plans[-1:] for h in plan.evict_blocks]
    assert evicted == idle_order[: len(evicted)] and len(evicted) == cached - 1
    cluster.drain()
    cluster.assert_nothing_held()


def test_a_conversations_next_turn_starts_after_its_cached_history_with_the_same_tokens():
    """Turn 2 sends turn 1's prompt, its answer and a new message: it finds every full block of
    turn 1 cached (at most all but its last token), prefills only the rest, and samples what the
    same request samples on an empty cache."""
    engine = tiny_engine(kv_blocks=40, kv_block_size=BLOCK)
    cluster = Cluster({"w": engine})
    first = list(range(30, 49))  # 19 tokens
    cluster.add("turn1", first, max_tokens=9)
    cluster.drain()
    second = first + cluster.output("turn1") + [60, 61, 62]
    cluster.add("turn2", second, max_tokens=8)
    cluster.drain()
    state = cluster.states["turn2"]
    # turn 1's KV covers its prompt and all its output but the last token (never fed): 27 tokens.
    assert state.cached_tokens == 27 // BLOCK * BLOCK == 24
    first_item = next(item for plan in cluster.plans for item in plan.items if item.request_id == "turn2")
    assert first_item.start_position == 24
    assert cluster.output("turn2") == generate_alone(tiny_engine(kv_blocks=40, kv_block_size=BLOCK), "x", second, 8)
    cluster.assert_nothing_held()


def test_a_prompt_cached_whole_still_feeds_its_last_token_to_sample_from():
    """The same block-aligned prompt twice: the second adopts all its blocks but the last (whose
    last token must be fed for the logits to sample from) and samples what the first sampled."""
    cluster = Cluster({"w": tiny_engine(kv_blocks=40, kv_block_size=BLOCK)})
    prompt = list(range(50, 50 + 3 * BLOCK))
    cluster.add("once", prompt, max_tokens=5)
    cluster.drain()
    cluster.add("again", prompt, max_tokens=5)
    cluster.drain()
    assert cluster.states["again"].cached_tokens == 2 * BLOCK
    assert cluster.output("again") == cluster.output("once")
    cluster.assert_nothing_held()


PENALTIES = {"repetition_penalty": 1.5, "frequency_penalty": 0.8, "presence_penalty": 0.6}


def test_penalties_count_the_whole_prompt_and_output_whatever_the_cache_preemption_or_a_dead_worker_did():
    """Greedy requests with all three penalties sample what they sample alone on an empty cache when
    their prompt comes from the cache (warm), when a preemption rebuilds them from cached blocks
    of their prompt and output, and when their worker dies and another holding their prefix takes
    them: the worker's penalty history is the whole prompt and output, not only the tokens fed to
    it (the cached blocks' tokens come with the request: NewRequest.cached_token_ids)."""
    prompt = [7, 8, 9, 7, 8, 9, 10, 11, 7, 8, 9, 12, 13]  # repeats: repetition_penalty has work to do

    def alone(prompt: list[int], max_tokens: int, penalties: dict) -> list[int]:
        return generate_alone(tiny_engine(kv_blocks=64, kv_block_size=BLOCK), "x", prompt, max_tokens,
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True, **penalties))

    expected = alone(prompt, 24, PENALTIES)
    assert expected != alone(prompt, 24, {}), "the penalties change nothing here: the test would prove nothing"
    # Warm: the second request adopts all the prompt's full blocks.
    cluster = Cluster({"w": tiny_engine(kv_blocks=40, kv_block_size=BLOCK)})
    cluster.add("cold", prompt, 24, **PENALTIES)
    cluster.drain()
    cluster.add("warm", prompt, 24, **PENALTIES)
    cluster.drain()
    assert cluster.states["warm"].cached_tokens == 3 * BLOCK
    assert cluster.output("cold") == cluster.output("warm") == expected
    # Preempted: a pool too small for two, the younger rebuilt from its cached prompt and output.
    cluster = Cluster({"w": tiny_engine(kv_blocks=16, kv_block_size=BLOCK)}, pipeline_depth=1)
    cluster.add("older", list(range(100, 113)), 30, **PENALTIES)
    cluster.add("younger", prompt, 24, **PENALTIES)
    cluster.drain()
    rebuilt = [new for plan in cluster.plans for new in plan.new_requests if new.request_id == "younger"]
    assert len(rebuilt) >= 2 and any(len(new.cached_token_ids) > len(prompt) for new in rebuilt), \
        "never rebuilt from cached blocks holding some of its output"
    assert cluster.output("younger") == expected
    # Its worker dies mid-output; the other worker holds its prompt's blocks (an earlier request's).
    cluster = Cluster({"w0": tiny_engine(kv_blocks=40, kv_block_size=BLOCK),
                       "w1": tiny_engine(kv_blocks=40, kv_block_size=BLOCK)}, placement="least-loaded")
    cluster.add("primer0", prompt + [15], 2, **PENALTIES)  # one on each worker
    cluster.add("primer1", prompt + [16], 2, **PENALTIES)
    cluster.drain()
    assert all(len(cluster.policy.worker(worker_id).cache) >= 3 for worker_id in ("w0", "w1"))
    cluster.add("moved", prompt + [14], 24, **PENALTIES)
    for _ in range(8):
        cluster.tick()
    dead = cluster.states["moved"].worker_id
    assert dead is not None and 0 < len(cluster.output("moved")) < 24
    cluster.kill(dead)
    cluster.drain()
    assert cluster.states["moved"].cached_tokens > 0
    assert cluster.output("moved") == alone(prompt + [14], 24, PENALTIES)
    cluster.assert_nothing_held()


def test_an_item_whose_penalty_history_would_have_a_gap_is_refused_not_run():
    """A request with penalties adopting cached blocks without their tokens (a scheduler that did
    not send them) would be penalised over part of its history: the engine refuses its item."""
    engine = tiny_engine(kv_blocks=16, kv_block_size=BLOCK)
    engine.add_request("a", SamplingParams(max_tokens=4))
    engine.step([prefill_item("a", list(range(20, 29)))])
    engine.take_plan(BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w", register_blocks=(
        ("a", 0, b"p" * 16), ("a", 1, b"q" * 16)), free_request_ids=("a",)))
    engine.take_plan(BatchPlan(scheduler_epoch="e", plan_id=2, worker_id="w", new_requests=(
        NewRequest(request_id="b", sampling=SamplingParams(max_tokens=4, **PENALTIES),
                   cached_blocks=(b"p" * 16, b"q" * 16)),)))
    outcome = engine.step([prefill_item("b", [28], start=8)])
    assert not outcome.tokens and [(error.request_id, error.code) for error in outcome.errors] == [("b", "bad_item")]
    assert "token history" in outcome.errors[0].message
    with pytest.raises(CacheMismatch):  # tokens that do not fill the blocks: the plan is refused
        engine.take_plan(BatchPlan(scheduler_epoch="e", plan_id=3, worker_id="w", new_requests=(
            NewRequest(request_id="c", sampling=SamplingParams(max_tokens=4, **PENALTIES),
                       cached_blocks=(b"p" * 16,), cached_token_ids=(1, 2)),)))


def test_without_prefix_caching_nothing_is_registered_or_adopted():
    cluster = Cluster({"w": emulated(kv_blocks=40)}, prefix_caching=False)
    cluster.add("a", list(range(30, 49)), max_tokens=4)
    cluster.drain()
    cluster.add("b", list(range(30, 49)), max_tokens=4)
    cluster.drain()
    assert cluster.states["b"].cached_tokens == 0 and cluster.policy.prefix_cache_hit_tokens == 0
    assert not any(plan.register_blocks or plan.evict_blocks for plan in cluster.plans)
    assert cluster.executors["w"].kv_cache.blocks_cached == 0


def test_cache_aware_placement_follows_the_prefix_unless_that_worker_is_too_loaded():
    """Requests sharing a cached prefix go to the worker holding it while it runs at most
    placement_slack (1) requests more than the other; past that, to the other."""
    cluster = Cluster({"w0": emulated(kv_blocks=64), "w1": emulated(kv_blocks=64)}, placement="cache-aware",
                      placement_slack=1, pipeline_depth=1)
    shared = list(range(100, 120))
    cluster.add("first", shared + [1], max_tokens=2)
    cluster.drain()
    home = next(plan.worker_id for plan in cluster.plans if plan.items)
    other = "w1" if home == "w0" else "w0"
    placed = []
    for index in range(4):
        cluster.add(f"r{index}", shared + [2 + index], max_tokens=40)
        cluster.tick()
        placed.append(cluster.states[f"r{index}"].worker_id)
    # loads (home, other) before each: (0, 0) -> home, (1, 0) -> home, (2, 0) -> other (past the slack),
    # (2, 1) -> other: r2 cached the prefix there too, and of two workers holding it the less loaded wins
    assert placed == [home, home, other, other]
    assert [cluster.states[f"r{index}"].adopted_blocks for index in range(4)] == [5, 5, 0, 5]
    cluster.drain()
    cluster.assert_nothing_held()


@pytest.mark.parametrize(("threshold", "goes_home"), [(0.5, False), (0.0, True)])
def test_a_short_cached_prefix_does_not_draw_a_request_away_from_the_least_loaded_worker(threshold, goes_home):
    """A worker holding only the first block of a 6-block request (a chat template's system prompt,
    seen by one worker and not yet the other) gets it only when placement_threshold allows; else
    the least loaded worker does, so new conversations do not all pile onto one worker."""
    cluster = Cluster({"w0": emulated(kv_blocks=64), "w1": emulated(kv_blocks=64)}, placement="cache-aware",
                      placement_threshold=threshold, pipeline_depth=1)
    preamble = list(range(100, 100 + BLOCK))
    cluster.add("long", preamble + [1, 2, 3], max_tokens=60)  # keeps running on its worker: load 1
    cluster.tick()
    home = cluster.states["long"].worker_id
    cluster.add("new", preamble + list(range(200, 200 + 5 * BLOCK)), max_tokens=4)
    cluster.tick()
    assert (cluster.states["new"].worker_id == home) is goes_home
    assert cluster.states["new"].adopted_blocks == (1 if goes_home else 0)
    cluster.drain()
    cluster.assert_nothing_held()


def test_least_loaded_placement_ignores_the_cache():
    cluster = Cluster({"w0": emulated(kv_blocks=64), "w1": emulated(kv_blocks=64)}, placement="least-loaded",
                      pipeline_depth=1)
    shared = list(range(100, 120))
    cluster.add("first", shared + [1], max_tokens=2)
    cluster.drain()
    for index in range(4):
        cluster.add(f"r{index}", shared + [2 + index], max_tokens=40)
        cluster.tick()
    placed = [cluster.states[f"r{index}"].worker_id for index in range(4)]
    assert sorted(placed) == ["w0", "w0", "w1", "w1"]


def test_block_hashes_name_a_whole_prefix_and_the_model():
    tokens = list(range(12))
    chains = []
    for salt, sequence in (("m", tokens), ("m", tokens[:4] + [99] + tokens[5:]), ("other", tokens)):
        chain: list[bytes] = []
        extend_chain(chain, root_hash(salt), lambda start, end, sequence=sequence: sequence[start:end], 4, 3)
        chains.append(chain)
    assert chains[0][0] == chains[1][0] and chains[0][1] != chains[1][1] and chains[0][2] != chains[1][2]
    assert not set(chains[0]) & set(chains[2])
    assert all(len(block_hash) == 16 for block_hash in chains[0])


# The real model against transformers, its prefixes from the cache


@pytest.mark.slow
def test_greedy_tokens_with_prefixes_from_the_cache_equal_transformers():
    """The transformers-oracle chat prompts (tests/test_engine.py) on SmolLM2: each run once, then
    again (all its blocks but the last from the cache), then a second turn over the first's history
    (the history from the cache): 24 greedy tokens each, identical to transformers' on the whole
    prompt. Tolerance: the tokens exactly; a cached prefix changes only how the prefill is chunked
    (the same float32 ops on the same positions, in other matmul shapes), which moves logits by
    about 1e-4, as batch composition does (tests/test_engine.py LOGITS_ATOL)."""
    from services.worker.engine import Engine
    from shared.config import Settings
    from shared.model_file import locate_gguf
    from shared.tokenizer import Tokenizer
    from tests.test_engine import CHAT_PROMPTS

    transformers = import_or_skip("transformers")
    torch.set_num_threads(2)
    path = locate_gguf()
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    tokenizer = Tokenizer.load()
    engine = Engine.from_settings(Settings(kv_blocks=256, device="cpu", dtype="float32"))
    cluster = Cluster({"w": engine}, max_batch_tokens=512)

    def expected(prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            return oracle.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()

    for index, messages in enumerate(CHAT_PROMPTS):
        prompt = tokenizer.encode_chat(messages)
        for run in ("first", "again"):
            cluster.add(f"{index}-{run}", prompt, max_tokens=24)
            cluster.drain()
        assert cluster.states[f"{index}-again"].cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
        first = cluster.output(f"{index}-first")
        assert first == cluster.output(f"{index}-again") == expected(prompt)
        history = messages + [{"role": "assistant", "content": tokenizer.decode(first)},
                              {"role": "user", "content": "Say it again in other words."}]
        second = tokenizer.encode_chat(history)
        cluster.add(f"{index}-turn2", second, max_tokens=24)
        cluster.drain()
        assert cluster.states[f"{index}-turn2"].cached_tokens >= len(prompt) // 16 * 16
        assert cluster.output(f"{index}-turn2") == expected(second), f"turn 2 of prompt {index}"
    cluster.assert_nothing_held()


def test_a_long_prompts_blocks_enter_the_cache_chunk_by_chunk_as_its_prefill_runs():
    # A prompt prefilled in chunks registers each chunk's full blocks as that chunk's result is
    # applied (SchedulerPolicy.on_result: where a chunk short of its prompt's end leaves the KV),
    # not only once the whole prompt has run, so a request sharing the prefix can find them sooner.
    cluster = Cluster({"w1": emulated(64)}, pipeline_depth=1)
    cluster.add("long", range(3, 63), max_tokens=2)  # 60 tokens: chunks of 24, 24 and 12
    cached = []
    for _ in range(3):
        cluster.plan("w1")
        assert cluster.run_one("w1")
        cached.append(len(cluster.policy.worker("w1").cache))
    assert cached == [6, 12, 15]  # full blocks of 4 tokens after 24, 48 and 60
    cluster.drain()
    cluster.assert_nothing_held()
