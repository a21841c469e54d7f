"""Where a waiting request goes, and the scheduler's copy of each worker's prefix cache.

Waiting requests are taken in fair order: round-robin across client keys, first come first served
within a key (_fair_order). For each, the worker planning its next step admits it when the batch and
its KV pool have room and it is where the request is meant to go (_admission_target):
- "cache-aware" (the default): the worker holding the longest prefix of it, when that prefix is at
  least placement_threshold of its tokens and that worker runs at most placement_slack requests more
  than the least loaded one (SGLang's router balances cache and load the same way);
- otherwise "least-loaded": the worker running the fewest requests (counting those already meant for
  it; ties: the most free KV). The planning worker takes a request meant for another only when that
  one is busy and runs no fewer requests.
A request admitted to a worker starts after the longest run of its block hashes that worker holds
(_cached_prefix, _admit). Blocks a result confirms written are registered (_register_blocks): the
scheduler's copy of the worker's cache (services/scheduler/prefix_cache.py) is exact by construction,
every change named in the plans.
"""

import logging
from typing import TYPE_CHECKING

from services.scheduler.prefix_cache import extend_chain
from services.scheduler.request_state import RequestState, WorkerState
from shared.config import REQUEST_LOG

if TYPE_CHECKING:
    from services.scheduler.batch_formation import Batch

request_log = logging.getLogger(REQUEST_LOG)  # each request's admission (Settings.log_requests)
log = logging.getLogger("iterserve.scheduler")


class RequestPlacement:
    """SchedulerPolicy's admission and placement (a mixin: the state is the policy's, made in its
    __init__: _waiting, _waiting_keys, _key_served_at, _admissions, _requests, _workers, and the
    prefix-cache counters)."""

    def _fair_order(self) -> list[str]:
        """Waiting requests in admission order: round-robin across client keys, FCFS within a key.

        Round r takes the r-th oldest request of every key, the keys in the order they were last
        served (never or longest ago first, then by their oldest request), so a key that floods
        the queue gets one turn per round like any other. With one key this is plain FCFS.
        """
        self._forget_keys_not_waiting()
        if len(self._waiting_keys) <= 1:
            return [request_id for _, _, request_id in self._waiting]
        by_key: dict[str, list[str]] = {}
        for _, _, request_id in self._waiting:
            by_key.setdefault(self._requests[request_id].record.client_key, []).append(request_id)
        turn = sorted(by_key, key=lambda key: self._key_served_at.get(key, -1))  # stable: oldest head first
        order = []
        for round_index in range(max(len(queue) for queue in by_key.values())):
            order.extend(by_key[key][round_index] for key in turn if round_index < len(by_key[key]))
        return order

    def _forget_keys_not_waiting(self) -> None:
        """A key with nothing waiting loses its turn's place: when it sends again, it goes first."""
        if not self._key_served_at.keys() <= self._waiting_keys.keys():
            self._key_served_at = {key: served for key, served in self._key_served_at.items()
                                   if key in self._waiting_keys}

    def _admit_waiting(self, batch: "Batch") -> None:
        """Waiting requests join in fair order while the batch and the KV cache have room."""
        worker = batch.worker
        if len(worker.running) >= self.max_batch_size or self.policy == "iteration" and batch.budget <= 0:
            self._forget_keys_not_waiting()  # (as _fair_order would have)
            return  # no room: nobody is looked at
        claimed: dict[str, tuple[int, int]] = {}  # other workers: blocks, requests meant for them
        for request_id in self._fair_order():
            if len(worker.running) >= self.max_batch_size:
                break
            if self.policy == "iteration" and batch.budget <= 0:
                break
            if request_id in worker.to_free:
                continue  # leaving this worker in this very plan: it may come back in a later one
            state = self._requests[request_id]
            blocks = worker.blocks_for(state.total_tokens)
            target, pinned = self._admission_target(state, worker, claimed)
            if target is None:
                if not any(other.blocks_for(state.total_tokens + 1) <= other.kv_blocks_total
                           for other in self._workers.values()):
                    self._end(state, "length")
                    self._finished_without_token.append(state)
                    log.warning("request_id=%s needs more KV than any worker has", request_id)
                continue
            if target is not worker:
                # Meant for a worker that holds its prefix, or runs fewer requests, or as many with
                # more free KV and plans soon; when that one is busy and no less loaded, the
                # planning worker takes it if it has room rather than let it wait.
                target_blocks, target_count = claimed.get(target.worker_id, (0, 0))
                busy_and_no_less_loaded = target.in_flight and len(target.running) + target_count >= len(worker.running)
                if pinned or not (busy_and_no_less_loaded and blocks <= worker.kv_blocks_available):
                    claimed[target.worker_id] = (target_blocks + target.blocks_for(state.total_tokens),
                                                 target_count + 1)
                    continue
            cached = self._cached_prefix(worker, state)
            idle_cached = worker.cache.idle_among(state.block_chain(worker.cache_root)[:cached]) if cached else 0
            if blocks - cached > worker.kv_blocks_available - idle_cached:
                break  # the next waiting request waits for room; the ones after it do not overtake it
            self._admit(batch, state, blocks, cached)

    def _cached_prefix(self, worker: WorkerState, state: RequestState) -> int:
        """How many of the request's first blocks the worker holds (all but its last token at most:
        that one is fed to sample from). None of them for a request that asked for its prompt's
        log-probabilities and has no output yet: every prompt position is computed for them."""
        if not self.prefix_caching or not worker.cache or (state.sampling.prompt_logprobs >= 0
                                                            and not state.output_token_ids):
            return 0
        limit = (state.total_tokens - 1) // worker.kv_block_size
        chain = state.block_chain(worker.cache_root)
        extend_chain(chain, worker.cache_root, state.tokens, worker.kv_block_size, limit)
        return worker.cache.match(chain, limit)

    def _admission_target(self, state: RequestState, planning: WorkerState,
                          claimed: dict[str, tuple[int, int]]) -> tuple[WorkerState | None, bool]:
        """Where a waiting request should go, and whether it should wait for that worker rather than
        start on another: under cache-aware placement the worker holding the longest prefix of it
        (ties: the least loaded) if that prefix is at least placement_threshold of its tokens and
        that worker's load (requests running and meant for it) is within placement_slack of the least
        loaded worker's; otherwise the least loaded live worker that takes new requests (ties: the
        most free KV blocks, then the planning worker, then the smaller id)."""
        best: tuple[tuple, WorkerState] | None = None
        loads: dict[str, int] = {}
        for worker in self._workers.values():
            if worker.draining or worker.blocks_for(state.total_tokens + 1) > worker.kv_blocks_total:
                continue
            claimed_blocks, claimed_count = claimed.get(worker.worker_id, (0, 0))
            if worker is not planning:
                if self.policy == "request" and worker.running:
                    continue
                if len(worker.running) + claimed_count >= self.max_batch_size:
                    continue
            loads[worker.worker_id] = len(worker.running) + claimed_count
            key = (loads[worker.worker_id], -(worker.kv_blocks_available - claimed_blocks), worker is not planning,
                   worker.worker_id)
            if best is None or key < best[0]:
                best = (key, worker)
        if best is None:
            return None, False
        if self.placement == "cache-aware" and self.prefix_caching:
            least = min(loads.values())
            cached = max(((self._cached_prefix(self._workers[worker_id], state), -load, worker_id)
                          for worker_id, load in loads.items() if load <= least + self.placement_slack))
            # A short match (a chat template's system prompt that one worker has seen and the other not
            # yet) must not draw every new conversation to one worker: SGLang's router's cache_threshold.
            if cached[0] > 0 and cached[0] * self._workers[cached[2]].kv_block_size >= \
                    self.placement_threshold * state.total_tokens:
                return self._workers[cached[2]], True
        return best[1], False

    def _admit(self, batch: "Batch", state: RequestState, blocks: int, cached: int = 0) -> None:
        """Start a request on the batch's worker, after the `cached` first blocks it finds there."""
        worker = batch.worker
        self._dequeue(state)
        hashes = state.block_chain(worker.cache_root)[:cached]
        worker.cache.acquire(hashes)
        state.held_hashes, state.adopted_blocks = list(hashes), cached
        cached_tokens = cached * worker.kv_block_size
        self.prefix_cache_queried_tokens += state.total_tokens
        self.prefix_cache_hit_tokens += cached_tokens
        if state.cached_tokens is None:
            state.cached_tokens = min(cached_tokens, len(state.prompt_token_ids))
        state.status, state.worker_id, state.computed = "running", worker.worker_id, cached_tokens
        state.kv_blocks, state.stepped_on_worker = blocks, False
        worker.take_blocks(blocks - cached)
        worker.running[state.request_id] = state
        worker.rows.add(state)
        batch.admitted.append(state.request_id)
        self._admissions += 1
        self._key_served_at[state.record.client_key] = self._admissions
        chunk = min(state.total_tokens - state.computed, batch.budget)
        if chunk > 0:  # the request policy admits its whole batch even past the token budget
            batch.chunks[state.request_id] = chunk
            batch.budget -= chunk
        request_log.info("admitted request_id=%s worker_id=%s tokens=%d output_tokens=%d cached_tokens=%d",
                         state.request_id, worker.worker_id, state.total_tokens, len(state.output_token_ids),
                         cached_tokens)

    def _register_blocks(self, worker: WorkerState, state: RequestState, end: int) -> None:
        """A result confirmed the request's KV written up to token `end` (all known): its blocks
        filled by then enter the worker's cache (a block whose contents another block holds already
        stays the request's)."""
        block_size = worker.kv_block_size
        full = end // block_size
        chain = state.block_chain(worker.cache_root)
        extend_chain(chain, worker.cache_root, state.tokens, block_size, full)
        for index in range(len(state.held_hashes), full):
            block_hash = chain[index]
            if worker.cache.add(block_hash):
                state.held_hashes.append(block_hash)
                worker.kv_blocks_reserved -= 1  # its own block is now the cache's, held by it
                worker.to_register.append((state.request_id, index, block_hash, state.row))
            else:
                state.held_hashes.append(None)
