"""A worker's token entries: the entries of the tokens it samples that end nothing, for the
requests whose plan said so (NewRequest.entries_below), written into the requests' token streams
with its result, so that the scheduler, the one process every token goes through, neither
detokenizes nor writes them (docs/protocol.md, "Token entries from the workers").

Two halves, each in the order plans run: `after_step` (where the result is encoded: the step
thread, or the event loop with pipeline stages) takes the plan's new and freed requests and decides
which of the step's tokens this worker writes; `entries` (the event loop, while the next step runs)
detokenizes them and packs them for WRITE_SCRIPT, which writes them before the result, in one
command: the scheduler reads a result only once its entries are in the streams.

A token is written when it is the next of its request here (its text continues this worker's
detokenizer) and does not end its request (shared/finishing.py: the scheduler writes that one, with
the finish and the usage). Every other token of such a request is named in the result as unwritten,
and the scheduler writes it; an entry written twice is refused by Redis (ids only grow).
"""

import collections
from dataclasses import dataclass

import msgpack

from shared import keys
from shared.finishing import finish_reason
from shared.messages import BatchPlan, NewRequest, PromptLogprobsChunk
from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.wire import encode, encode_plain_token_events

# Per entry of msgpack columns [stream keys, entry ids, payloads, request keys, request ids]: XADD to
# a stream that is there (NOMKSTREAM: one command for most entries, which changes no key's time to
# live). A stream that is not is made only for a request whose hash is there (a hash gone: nobody
# reads it; the entry would only leave a key behind without an expiry), and given the hash's time
# to live if its request ended. An entry written before is skipped. Redis refusing writes (out of
# memory, a read-only replica, failing persistence) stops the script before the result is added, and
# comes back as its reply: the worker sends it all again. An entry that fails for its key (a key of
# the wrong type) is left out and its request named in the result's field `f` (msgpack list of ids):
# the scheduler fails that request, as for its own writes. Then XADD of the results, in order:
# KEYS[1] the results stream, ARGV[2] the first result, ARGV[5...] the others (the plans answered
# together: Settings.answer_every), ARGV[3] the stream's approximate length; `f` goes with the
# last. (EVAL with the script's text: a restarted Redis has no script cache.)
# First of all, KEYS[2] (ModelKeys.incarnation) must hold the plan's scheduler epoch (ARGV[4]) and
# this Redis server's run_id: if not, nothing is written and the reply is STALE. A Redis restarted
# may have lost its last writes (appendfsync everysec: docs/operations.md, "fsync policy"), and an entry written
# from memory after them would leave a gap in its stream; so no entry lands until the scheduler has
# seen the restart and loaded the pool from what Redis kept, under a new epoch. (A plan's result is
# not needed then: the scheduler ignores any of an older epoch.)
# Before the entries, columns[6]: fields of request hashes [request key, field, value], each set only
# where its hash is there (the prompt's log-probabilities: note_prompt_logprobs), so that a request's
# are in its hash before the entry of its first token.
STALE = b"STALE"
WRITE_SCRIPT = f"""
if redis.call('GET', KEYS[2]) ~= ARGV[4] .. ' ' .. {keys.REDIS_RUN_ID_LUA} then
  return redis.status_reply('STALE')
end
""" + """local columns = cmsgpack.unpack(ARGV[1])
local stream_keys, entry_ids, payloads, request_keys = columns[1], columns[2], columns[3], columns[4]
local refusals = {'OOM', 'READONLY', 'MISCONF', 'NOREPLICAS', 'MASTERDOWN'}
local failed = {}
local fields = columns[6] or {}
for i = 1, #fields do
  if redis.call('EXISTS', fields[i][1]) == 1 then
    local reply = redis.pcall('HSET', fields[i][1], fields[i][2], fields[i][3])
    if type(reply) == 'table' and reply.err then
      for _, prefix in ipairs(refusals) do
        if string.sub(reply.err, 1, #prefix) == prefix then
          return reply
        end
      end
    end
  end
end
for i = 1, #stream_keys do
  local reply = redis.pcall('XADD', stream_keys[i], 'NOMKSTREAM', entry_ids[i], 'm', payloads[i])
  if reply == false then
    local ttl = redis.call('PTTL', request_keys[i])
    if ttl ~= -2 then
      reply = redis.pcall('XADD', stream_keys[i], entry_ids[i], 'm', payloads[i])
      if ttl >= 0 and type(reply) ~= 'table' then
        redis.call('PEXPIRE', stream_keys[i], ttl)
      end
    end
  end
  if type(reply) == 'table' and reply.err and not string.find(reply.err, 'equal or smaller', 1, true) then
    for _, prefix in ipairs(refusals) do
      if string.sub(reply.err, 1, #prefix) == prefix then
        return reply
      end
    end
    failed[#failed + 1] = columns[5][i]
  end
end
local results = {ARGV[2]}
for i = 5, #ARGV do
  results[#results + 1] = ARGV[i]
end
local added
for i, result in ipairs(results) do
  if i == #results and #failed > 0 then
    added = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'm', result, 'f', cmsgpack.pack(failed))
  else
    added = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'm', result)
  end
end
return added
"""


@dataclass(eq=False, slots=True)
class _Row:
    """A request this worker writes token entries for (from its NewRequest to its free)."""

    request_id: str
    stream_key: str  # its token stream's
    request_key: str  # its hash's (the script writes nothing for a request whose hash is gone)
    next_index: int  # the output index whose entry this worker writes next
    entries_below: int  # the token at entries_below - 1 ends the request by length
    ignore_eos: bool
    context: tuple[int, ...]  # the detokenizer's start (Tokenizer.text_context)
    ended: bool = False  # a token ended it, or one came out of step: nothing more is written here
    detokenizer: IncrementalDetokenizer | None = None  # the event loop's (made at the first entry)


Write = tuple[_Row, int, int]  # (row, output index, token id): an entry to write


class TokenWriter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(tokenizer.stop_token_ids)
        self._rows: dict[str, _Row] = {}
        self._epoch = ""
        # [request key, field, value] to set with the next entries (noted by the step thread, taken
        # by the event loop: a deque's append and popleft are atomic)
        self._fields: collections.deque[list] = collections.deque()

    def note_prompt_logprobs(self, chunks: dict[str, PromptLogprobsChunk]) -> None:
        """Prompt log-probabilities a step computed, to write with its result (or an earlier one:
        written early does no harm, written late would follow the first token's entry)."""
        for request_id, chunk in chunks.items():
            self._fields.append([keys.request_key(request_id), keys.prompt_logprobs_field(chunk.first_position),
                                 encode(chunk)])

    @property
    def has_fields(self) -> bool:
        return bool(self._fields)

    def after_step(self, plan: BatchPlan, tokens: dict[str, int], speculated: dict[str, list[int]] | None = None,
                   ) -> tuple[list[Write], dict[str, int] | None]:
        """A plan run (or refused): its changes, then which of its tokens this worker writes, and
        the requests whose tokens it was to write and does not, each with the first of its step's
        tokens it leaves (0 but for a speculating item, whose kept tokens are `speculated`'s; None:
        it writes for none)."""
        if plan.scheduler_epoch != self._epoch or plan.free_all:
            self._epoch = plan.scheduler_epoch
            self._rows.clear()
        rows = self._rows
        for request_id in plan.free_request_ids:
            rows.pop(request_id, None)
        for new in plan.new_requests:
            if new.entries_below:
                rows[new.request_id] = _row(new)
            else:
                rows.pop(new.request_id, None)
        if not rows:
            return [], None
        writes: list[Write] = []
        unwritten: dict[str, int] = {}
        stop_token_ids = self.stop_token_ids
        for item in plan.items:
            row = rows.get(item.request_id)
            if row is None or not item.sample or (token_id := tokens.get(item.request_id)) is None:
                continue
            step_tokens = speculated.get(item.request_id) if speculated and item.draft_tokens else None
            for at, token_id in enumerate(step_tokens or (token_id,)):
                index = item.output_index + at
                if row.ended or index != row.next_index:
                    # Sampled here before (its entry was written, or the scheduler's to write: it writes
                    # it again, Redis skips it), or out of step with this worker's text: the scheduler's.
                    unwritten[item.request_id] = at
                    row.ended = row.ended or index > row.next_index
                    break
                row.next_index = index + 1
                # (finish_reason's tests first, inline: most tokens end nothing)
                if (token_id in stop_token_ids or index + 1 >= row.entries_below) and finish_reason(
                        token_id, index + 1, row.entries_below, stop_token_ids, row.ignore_eos) is not None:
                    row.ended = True  # its entry is the scheduler's; tokens sampled past it are nobody's
                    unwritten[item.request_id] = at
                    break
                writes.append((row, index, token_id))
        return writes, unwritten

    def entries(self, writes: list[Write]) -> bytes:
        """The entries, in order, as WRITE_SCRIPT's first argument. (use_bin_type=False: Redis's
        Lua cmsgpack reads only the raw string type.)"""
        rows, indexes, token_ids = zip(*writes) if writes else ((), (), ())
        for row in rows:
            if row.detokenizer is None:
                row.detokenizer = IncrementalDetokenizer(self.tokenizer, row.context)
        pieces = [row.detokenizer.push(token_id) for row, token_id in zip(rows, token_ids)]  # (in order)
        fields = [self._fields.popleft() for _ in range(len(self._fields))]
        return msgpack.packb([[row.stream_key for row in rows], [f"0-{index + 1}" for index in indexes],
                              encode_plain_token_events(indexes, token_ids, pieces),
                              [row.request_key for row in rows], [row.request_id for row in rows], fields],
                             use_bin_type=False)


def _row(new: NewRequest) -> _Row:
    return _Row(new.request_id, keys.token_stream(new.request_id), keys.request_key(new.request_id),
                new.first_output_index, new.entries_below, new.sampling.ignore_eos, new.text_context)
