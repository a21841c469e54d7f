"""Requests' output as the gateways read it: text from tokens, stop strings, the token stream's
entries and a request's end (status, active set, expiries).

Output token i of a request is entry id 0-(i+1) of its token stream: a write repeated after a lost
reply, or by a restarted scheduler, is refused by Redis instead of duplicated. Most entries are
the workers' (services/worker/token_writer.py: a request without stop strings or logprobs, under
the iteration policy, a token that ends nothing): such a request's tokens are not detokenized here,
and its entries written here (its last token's, with the finish and the usage, and any its worker
says it did not write) take their text from the tokens alone (shared/tokenizer.py, piece_after).
Every other request's text is decoded here, incrementally: stop strings are searched here.
"""

import logging
from dataclasses import dataclass
from typing import Any

from services.scheduler.held_results import ResultHolding
from services.scheduler.policy import SchedulerPolicy, TokenOutcome, status_for
from services.scheduler.redis_link import TOKEN_ENTRY, RedisLink, SchedulerStateError, Write
from services.scheduler.request_state import RequestState
from shared import keys
from shared.config import REQUEST_LOG
from shared.messages import FinishReason, RequestRecord
from shared.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, held_back_length, piece_after
from shared.wire import encode_token_event

log = logging.getLogger("iterserve.scheduler")
request_log = logging.getLogger(REQUEST_LOG)  # each request's end (Settings.log_requests)

REMEMBERED_IDS = 100_000  # recently finished ids: a duplicate new-request entry is not loaded again


def token_entry_id(index: int) -> str:
    return f"0-{index + 1}"


# An end without a token (cancelled, failed, finished between tokens) takes an id no token's entry
# takes, past all of them: an entry at the next token's index that this process has not seen (a
# worker's, once workers write token entries: docs/scaling.md, step 1) would otherwise make Redis
# skip the end as already written. Entries after it are not read (a reader stops at a final event).
END_ENTRY_ID = "1-0"


@dataclass(eq=False)
class OutputText:
    """A request's output text as streamed so far."""

    detokenizer: IncrementalDetokenizer
    stream_key: str  # its token stream's key
    emitted: int = 0  # characters of detokenizer.text already sent in TokenEvents
    checked: int = 0  # characters already searched for stop strings
    # The first characters of its stop strings: a piece holding none of them, after text of which
    # nothing is held back, can neither end a stop string nor begin one (any stop string ending in
    # it would have begun in it: text before it began none, or some would be held back), so the
    # token needs no search (publish_tokens); most tokens of most requests with stop strings.
    stop_starts: frozenset[str] = frozenset()


class BoundedSet:
    """Insertion-ordered set that forgets its oldest members beyond a limit."""

    def __init__(self, limit: int) -> None:
        self._items: dict[str, None] = {}
        self._limit = limit

    def add(self, item: str) -> None:
        self._items.pop(item, None)
        self._items[item] = None
        while len(self._items) > self._limit:
            del self._items[next(iter(self._items))]

    def discard(self, item: str) -> None:
        self._items.pop(item, None)

    def __contains__(self, item: object) -> bool:
        return item in self._items


class RequestOutputs:
    def __init__(self, tokenizer: Tokenizer, policy: SchedulerPolicy, link: RedisLink, holding: ResultHolding,
                 request_ttl_seconds: int) -> None:
        self.tokenizer, self.policy, self.link, self.holding = tokenizer, policy, link, holding
        self.request_ttl_seconds = request_ttl_seconds
        self._outputs: dict[str, OutputText] = {}
        self._marked_running: set[str] = set()  # status "running" written in this run
        self.recently_finished = BoundedSet(REMEMBERED_IDS)
        self._write_failures = BoundedSet(REMEMBERED_IDS)  # requests failed for a write Redis refused

    # A request's text

    def start(self, record: RequestRecord, output_token_ids: list[int], emitted_text: int) -> str:
        """A request's output so far (loaded from Redis, or empty); returns its text."""
        output = OutputText(IncrementalDetokenizer(self.tokenizer, record.prompt_token_ids),
                            keys.token_stream(record.request_id),
                            stop_starts=frozenset(stop[0] for stop in record.sampling.stop if stop))
        for token_id in output_token_ids:
            output.detokenizer.push(token_id)
        output.emitted = emitted_text
        output.checked = len(output.detokenizer.text)
        self._outputs[record.request_id] = output
        return output.detokenizer.text

    def mark_running(self, request_id: str) -> None:
        if request_id not in self._marked_running:
            self._marked_running.add(request_id)
            self.link.queue("hset", keys.request_key(request_id), "status", "running")

    def publish_tokens(self, outcomes: list[TokenOutcome], worker_id: str) -> None:
        """A result's tokens, in order: each one's text and token entry (and its request's end).
        Tokens whose entry the worker wrote (TokenOutcome.written) need nothing (the policy leaves
        most of them out already). The common case of the rest (nothing
        held back, nothing ends, no stop string can end or begin in the piece, no log-probabilities)
        is inline here, the others in _publish; one call per result, not per token."""
        holding = self.holding
        if holding.enabled:  # the request-level baseline: its writes wait for its batch
            for outcome in outcomes:
                holding.hold(outcome.request.request_id, worker_id)
        outputs, queue_token, plain = self._outputs, self.link.queue_token, not holding.enabled
        for outcome in outcomes:
            state, token_id, index, finish_reason, logprob, top_logprobs, written = outcome  # (no attribute reads)
            request_id = state.request_id
            output = outputs[request_id]
            if state.workers_write:  # (its detokenizer here is not used: text comes from the tokens)
                if not written:
                    self._publish_from_tokens(outcome, output)
                elif finish_reason is not None:
                    self._end_after_worker_entry(outcome)
                continue  # (else the worker wrote it: most tokens)
            detokenizer = output.detokenizer
            piece = detokenizer.push(token_id)
            stop_starts = output.stop_starts
            if finish_reason is not None or output.emitted != detokenizer.length - len(piece) or (
                    stop_starts and not stop_starts.isdisjoint(piece)):
                self._publish(outcome, output)  # it ends, text is held back, or a stop string may end or begin
                continue
            output.emitted = detokenizer.length
            if plain and logprob is None:
                queue_token(request_id, output.stream_key, f"0-{index + 1}", encode_token_event(index, token_id, piece))
            else:
                self.token_event(request_id, index, token_id, piece, logprob=logprob, top_logprobs=top_logprobs)

    def _publish(self, outcome: TokenOutcome, output: OutputText) -> None:
        """A token (its text pushed) that ends its request or whose text may be held back: stop
        strings, held-back text, its request's end."""
        state = outcome.request
        request_id = state.request_id
        finish = outcome.finish_reason
        detokenizer = output.detokenizer
        if finish is not None:
            detokenizer.flush()
        stop = state.sampling.stop
        text = detokenizer.text
        end = len(text)
        if stop:
            found = find_stop(text, stop, output.checked)
            output.checked = len(text)
            if found != -1:
                end = found
                if finish is None:
                    self.policy.finish(request_id, "stop")
                finish = "stop"
            elif finish is None:
                end -= held_back_length(text, stop)  # might be the start of a stop string
        piece = text[output.emitted : end] if end > output.emitted else ""
        output.emitted = max(output.emitted, end)
        if finish is None and outcome.logprob is None and not self.holding.enabled:  # (no keyword arguments)
            self.link.queue_token(request_id, output.stream_key, token_entry_id(outcome.output_index),
                                  encode_token_event(outcome.output_index, outcome.token_id, piece))
            return
        completion_tokens = len(state.output_token_ids)
        self.token_event(request_id, outcome.output_index, outcome.token_id, piece, finish_reason=finish,
                         prompt_tokens=len(state.prompt_token_ids) if finish else 0,
                         completion_tokens=completion_tokens if finish else 0,
                         cached_tokens=state.cached_tokens or 0 if finish else 0,
                         logprob=outcome.logprob, top_logprobs=outcome.top_logprobs)
        if finish is not None:
            self.write_end(request_id, finish, completion_tokens)

    def _publish_from_tokens(self, outcome: TokenOutcome, output: OutputText) -> None:
        """A token of a request whose worker writes its entries that it did not write: it ends the
        request (the entry with the finish and the usage), or its worker could not write it."""
        state, token_id, index, finish = outcome.request, outcome.token_id, outcome.output_index, outcome.finish_reason
        context = self.tokenizer.text_context(state.prompt_token_ids, state.output_token_ids[:index])
        piece = piece_after(self.tokenizer, context, token_id, last=finish is not None)
        if finish is None:
            self.link.queue_token(state.request_id, output.stream_key, token_entry_id(index),
                                  encode_token_event(index, token_id, piece))
            return
        completion_tokens = len(state.output_token_ids)
        self.token_event(state.request_id, index, token_id, piece, finish_reason=finish,
                         prompt_tokens=len(state.prompt_token_ids), completion_tokens=completion_tokens,
                         cached_tokens=state.cached_tokens or 0)
        self.write_end(state.request_id, finish, completion_tokens)

    def _end_after_worker_entry(self, outcome: TokenOutcome) -> None:
        """A token that ends its request, which its worker wrote as one that does not (the two did not
        decide alike: they should, shared/finishing.py): the end goes after it, without a token."""
        state = outcome.request
        log.warning("worker_wrote_last_token request_id=%s output_index=%d", state.request_id, outcome.output_index)
        state.finish_reason = outcome.finish_reason
        self._final_event_without_token(state)

    def publish_finished_without_token(self) -> None:
        for state in self.policy.take_finished_without_token():
            self._final_event_without_token(state)

    def _final_event_without_token(self, state: RequestState) -> None:
        """A request that ended between tokens: release its held-back text in a token-less entry."""
        request_id = state.request_id
        reason = state.finish_reason or "error"
        piece = ""
        output = self._outputs.get(request_id)
        if output is not None and reason != "cancelled" and state.workers_write:  # (no stop strings)
            piece = IncrementalDetokenizer(self.tokenizer, self.tokenizer.text_context(
                state.prompt_token_ids, state.output_token_ids)).flush()
        elif output is not None and reason != "cancelled":
            output.detokenizer.flush()
            text = output.detokenizer.text
            end = len(text)
            if state.sampling.stop and (found := find_stop(text, state.sampling.stop)) != -1:
                end = found
            piece = text[output.emitted : end] if end > output.emitted else ""
        completion_tokens = len(state.output_token_ids)
        self.token_event(request_id, completion_tokens, -1, piece, finish_reason=reason,
                         prompt_tokens=len(state.prompt_token_ids), completion_tokens=completion_tokens,
                         cached_tokens=state.cached_tokens or 0)
        self.write_end(request_id, reason, completion_tokens)

    def cancelled(self, state: RequestState) -> None:
        completion_tokens = len(state.output_token_ids)
        self.token_event(state.request_id, completion_tokens, -1, "", finish_reason="cancelled",
                         prompt_tokens=len(state.prompt_token_ids), completion_tokens=completion_tokens,
                         cached_tokens=state.cached_tokens or 0)
        self.write_end(state.request_id, "cancelled", completion_tokens)

    # Writes

    def token_event(self, request_id: str, index: int, token_id: int, text: str, **rest: Any) -> None:
        """One entry of the request's token stream (batched with the round trip's others: one EVAL);
        token_id -1: an end without a token."""
        entry_id = token_entry_id(index) if token_id >= 0 else END_ENTRY_ID
        args = (keys.token_stream(request_id), entry_id, encode_token_event(index, token_id, text, **rest))
        if not (self.holding.enabled and self.holding.keep(Write(TOKEN_ENTRY, args, {}, request_id))):
            self.link.queue_token(request_id, *args)

    def write_end(self, request_id: str, reason: FinishReason, completion_tokens: int) -> None:
        ttl = self.request_ttl_seconds
        self._write(request_id, "hset", keys.request_key(request_id),
                    mapping={"status": status_for(reason), "finish_reason": reason})
        self._write(request_id, "srem", self.link.keys.active_requests, request_id)
        if self.link.scheduler_id:  # one of several: the request is nobody's now
            self._write(request_id, "hdel", self.link.keys.request_owners, request_id)
        self._write(request_id, "expire", keys.request_key(request_id), ttl)
        self._write(request_id, "expire", keys.token_stream(request_id), ttl)
        self._outputs.pop(request_id, None)
        self._marked_running.discard(request_id)
        self.recently_finished.add(request_id)
        request_log.info("finished request_id=%s reason=%s completion_tokens=%d", request_id, reason,
                         completion_tokens)

    def _write(self, request_id: str, command: str, *args: Any, **kwargs: Any) -> None:
        """A write to one request's keys (held while its request-level batch runs)."""
        write = Write(command, args, kwargs, request_id)
        if not self.holding.keep(write):
            self.link.writes.append(write)

    def expire_unreadable(self, request_id: str) -> None:
        """A request whose keys cannot be read (the wrong type): end it as failed."""
        self._write_failures.add(request_id)
        self.write_end(request_id, "error", 0)

    def write_failed(self, write: Write, error: Exception) -> None:
        """A write Redis refused inside the transaction, for its key: a request's makes it fail (its
        client is told); a shared key's means Redis and the scheduler disagree: stop."""
        if write.command == "xadd" and write.request_id and "equal or smaller" in str(error):
            return  # this token entry was written before (a round trip sent again): nothing to redo
        key = write.args[0] if write.args else ""
        log.error("redis_write_failed command=%s key=%s request_id=%s error=%s", write.command, key,
                  write.request_id, error)
        if write.request_id is None:
            raise SchedulerStateError(f"{write.command} {key!r} failed in Redis: {error}")
        if write.request_id in self._write_failures:
            return  # its end was written (or failed) once already
        self._write_failures.add(write.request_id)
        # Its output can no longer be written whole: end it as failed, which its client is told
        # (the status in its hash, or, if that key is broken too, its key's absence, ends the follower).
        state = self.policy.finish(write.request_id, "error")
        if state is not None:
            self.holding.drop(write.request_id)
            self.write_end(write.request_id, "error", len(state.output_token_ids))
