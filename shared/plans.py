"""Plans and results on the wire: columnar, compact, validated once at the edge.

A request is known to a worker by a small integer handle, given with its full data (id and
sampling parameters) the first time a plan sends it there; every later plan names only the
handle and what changed (vLLM v1's new / cached request data). An item is one of:

- a decode: the request feeds the token it sampled in the plan before (pipelined) and samples the
  next: its handle and output index only, 6 bytes;
- anything else (a prompt chunk, a rebuild, a decode that feeds a token the scheduler names):
  handle, start position, token count, whether it samples, output index, and its tokens.

Each field is one little-endian array for the whole plan (msgpack binary), so a plan of 64
decoding requests is about 450 bytes and its result (a token per request) about 650. Results
name their tokens by handle too, and repeat the output index they sampled (the scheduler checks
it). The scheduler's policy hands out the handles (a request's row on the worker:
services/scheduler/running_rows.py) and builds each plan as these columns (ColumnPlan,
encode_plan); it reads results as columns too (read_result_columns), so no object is made per item
on its side. The worker reads a plan whole, validated, by handle (read_plan), resolves the handles
in its own table and packs its answer (pack_result): services/worker/plan_reader.py.
(services/bench/by_request_id.py makes the same plans from BatchPlans, by request id, for tests and
tools.) This module is the format alone: it holds no state.

A plan whose every item samples (decodes, prompts' last chunks) may say it runs several steps
(Settings.scheduler_steps, vLLM v0's multi-step scheduling): the worker runs it, then runs its
items again as decodes that feed the token each sampled, output index and plan id one more each
step, for as many steps as the plan says (each item: `item_steps`, where some run fewer: a request
that reaches its max_tokens), and answers all the steps with one result: each item's
tokens one after another, with their count. So the scheduler plans, encodes, reads and applies
once for N worker-iterations.

Speculative decoding adds one column, only where an item proposes: each named item's count of
proposed tokens (the last of its tokens, StepItem.draft_tokens; a plan with proposals runs one step).
The answer gives such an item every token it kept, as the answer to several steps gives each
step's: a count per item, its tokens one after another, and which were left unwritten by position.

Prefix caching adds three fields, all empty when it is off: blocks to register (handles, block
indexes, hashes), hashes of blocks to evict, and on a new request the hashes of the cached blocks
it starts with (hashes are 16 bytes each, concatenated) and, for a request with penalties only,
the tokens those blocks hold (its penalty history starts with them).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from shared.keys import valid_request_id
from shared.messages import NewRequest, SamplingParams, StepItem
from shared.speculative import MAX_SPECULATIVE_TOKENS
from shared.wire import WireError

PLAN_FORMAT = 5  # 5: proposed tokens (speculative decoding), which a format-4 worker would feed as a prompt
MAX_HANDLE = 65535  # handles are uint16 on the wire
MAX_INDEX = 2**31
MAX_STEPS = 16  # steps one plan may run (Settings.scheduler_steps)
ERROR_CODES = ("kv_cache_full", "out_of_memory", "unknown_request", "bad_item", "cache_mismatch")
HASH_BYTES = 16  # a prefix-cache block hash (services/scheduler/prefix_cache.py)
_I32, _U16 = np.dtype("<i4"), np.dtype("<u2")
_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False  # shared by every empty field
_RANGES = {dtype: (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max) + 1)  # [smallest, past the largest]
           for dtype in (_I32, _U16, np.dtype(np.uint8))}


def _hashes(data: Any, kind: str, name: str) -> tuple[bytes, ...]:
    if not isinstance(data, bytes) or len(data) % HASH_BYTES:
        raise WireError(f"{kind}: field {name!r} is not a whole number of {HASH_BYTES}-byte hashes")
    return tuple(data[start : start + HASH_BYTES] for start in range(0, len(data), HASH_BYTES))


def _array(values, dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def _unpack(kind: str, data: bytes) -> dict:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise WireError(f"{kind}: not msgpack: {error}") from error
    if not isinstance(raw, dict) or raw.get("f") != PLAN_FORMAT:
        raise WireError(f"{kind}: not a format-{PLAN_FORMAT} message")
    return raw


def _field(raw: dict, kind: str, name: str, types, default: Any = ...) -> Any:
    value = raw.get(name, default)
    if value is ... or not isinstance(value, types) or isinstance(value, bool) and bool not in (
            types if isinstance(types, tuple) else (types,)):
        raise WireError(f"{kind}: field {name!r} missing or of the wrong type")
    return value


def _ints(raw: dict, kind: str, name: str, dtype: np.dtype, low: int = 0, high: int = MAX_INDEX) -> np.ndarray:
    data = _field(raw, kind, name, bytes, b"")
    if not data:
        return _NONE  # (most of a plan's fields, most steps)
    if len(data) % dtype.itemsize:
        raise WireError(f"{kind}: field {name!r} is not a whole number of {dtype}")
    values = np.frombuffer(data, dtype=dtype).astype(np.int64)
    smallest, past_largest = _RANGES[dtype]  # (a bound the type itself keeps needs no pass over the values)
    if low > smallest and values.min() < low or high < past_largest and values.max() >= high:
        raise WireError(f"{kind}: field {name!r} outside [{low}, {high})")
    return values


def _int_list(raw: dict, kind: str, name: str, dtype: np.dtype, low: int = 0, high: int = MAX_INDEX) -> list[int]:
    """_ints as a list (the scheduler's side reads each value once, in Python)."""
    data = raw.get(name, b"")
    if not data:
        return []
    if not isinstance(data, bytes) or len(data) % dtype.itemsize:
        raise WireError(f"{kind}: field {name!r} is not a whole number of {dtype}")
    values = np.frombuffer(data, dtype=dtype).tolist()
    smallest, past_largest = _RANGES[dtype]
    if low > smallest and min(values) < low or high < past_largest and max(values) >= high:
        raise WireError(f"{kind}: field {name!r} outside [{low}, {high})")
    return values


@dataclass(eq=False)
class ColumnPlan:
    """A plan as the scheduler sends it: each request named by its handle on the worker (the row it
    holds in the scheduler's RunningRows), its items as columns, in wire order. The request ids
    ride along for the scheduler's own records and for `items`, the plan as BatchPlan's items
    (tests and tools read plans that way; the hot path never builds them)."""

    scheduler_epoch: str
    plan_id: int
    worker_id: str
    free_all: bool = False
    new_requests: tuple[NewRequest, ...] = ()
    new_handles: tuple[int, ...] = ()
    free_request_ids: tuple[str, ...] = ()
    free_handles: tuple[int, ...] = ()
    register_blocks: tuple[tuple[str, int, bytes], ...] = ()  # (request id, block index, hash)
    register_handles: tuple[int, ...] = ()
    evict_blocks: tuple[bytes, ...] = ()
    # Decodes that feed the token the worker sampled for them in the plan before: handle and output
    # index (and start position, which the worker knows: for `items` only).
    decode_handles: Sequence[int] = ()
    decode_outputs: Sequence[int] = ()
    decode_starts: Sequence[int] = ()
    # The other items: handle, start position, token count, whether it samples, output index; and
    # their tokens, flattened.
    handles: Sequence[int] = ()
    starts: Sequence[int] = ()
    counts: Sequence[int] = ()
    samples: Sequence[bool] = ()
    outputs: Sequence[int] = ()
    tokens: Sequence[int] = ()
    item_ids: tuple[str, ...] = ()  # each item's request id: the decodes, then the others
    # The worker holds this plan's result and writes it with the next plan's (Settings.answer_every).
    answer_with_next: bool = False
    # Steps the plan runs (Settings.scheduler_steps; every item samples), and each item's, in wire
    # order, where some run fewer (empty: all run `steps`).
    steps: int = 1
    item_steps: Sequence[int] = ()
    # Speculative decoding: each of the other items' proposed tokens, the last of its tokens (empty:
    # none proposes; StepItem.draft_tokens). A plan with proposals runs one step.
    drafts: Sequence[int] = ()

    @property
    def item_count(self) -> int:
        return len(self.item_ids)

    @property
    def items(self) -> tuple[StepItem, ...]:
        decodes = len(self.decode_handles)
        items = [StepItem(request_id, (), start, True, output_index, True) for request_id, start, output_index
                 in zip(self.item_ids[:decodes], self.decode_starts, self.decode_outputs, strict=True)]
        begin = 0
        drafts = self.drafts or [0] * len(self.handles)
        for request_id, start, count, sample, output_index, draft in zip(
                self.item_ids[decodes:], self.starts, self.counts, self.samples, self.outputs, drafts, strict=True):
            items.append(StepItem(request_id, tuple(self.tokens[begin : begin + count]), start, bool(sample),
                                  output_index, False, draft))
            begin += count
        return tuple(items)


def encode_plan(plan: ColumnPlan) -> bytes:
    new = []
    for handle, request in zip(plan.new_handles, plan.new_requests, strict=True):
        entry = [handle, request.request_id, request.sampling.model_dump(mode="python"), b"".join(request.cached_blocks),
                 _array(request.cached_token_ids, _I32)]
        if request.entries_below:
            entry += [request.entries_below, request.first_output_index, _array(request.text_context, _I32)]
        new.append(entry)
    message = {"f": PLAN_FORMAT, "e": plan.scheduler_epoch, "p": plan.plan_id, "w": plan.worker_id,
               "a": plan.free_all, "n": new, "x": _array(plan.free_handles, _U16),
               "dh": _array(plan.decode_handles, _U16), "do": _array(plan.decode_outputs, _I32)}
    if plan.register_blocks:
        message |= {"rh": _array(plan.register_handles, _U16),
                    "ri": _array([index for _, index, _ in plan.register_blocks], _I32),
                    "rk": b"".join(block_hash for _, _, block_hash in plan.register_blocks)}
    if plan.evict_blocks:
        message["ev"] = b"".join(plan.evict_blocks)
    if plan.answer_with_next:
        message["g"] = True
    if plan.steps > 1:
        message["k"] = plan.steps
        if len(plan.item_steps):
            message["ks"] = _array(plan.item_steps, np.uint8)
    if len(plan.handles):
        message |= {"h": _array(plan.handles, _U16), "s": _array(plan.starts, _I32), "c": _array(plan.counts, _I32),
                    "m": _array(plan.samples, np.uint8), "o": _array(plan.outputs, _I32),
                    "t": _array(plan.tokens, _I32)}
        if len(plan.drafts):
            message["d"] = _array(plan.drafts, np.uint8)
    return msgpack.packb(message, use_bin_type=True)


@dataclass(eq=False, slots=True)
class ResultColumns:
    """A worker's answer as the scheduler reads it: its tokens by handle, as columns (each handle
    read as the plan it answers named it: the scheduler's PlanInFlight knows how).

    The answer to a plan of several steps (steps > 1) is one result for all of them: each handle
    once, with `counts` tokens (its steps answered, from the plan's first), `token_ids` item-major
    (a handle's tokens one after another), `output_indexes` each handle's first; an item in error
    answered the steps before its error (its count: the step the error came in, 0 when it has
    no token). logprobs and unwritten_tokens name positions among token_ids. split_steps reads it
    as one result per step. The answer to one step where an item kept proposed tokens (speculative
    decoding) has counts and unwritten_tokens too, with steps 1: that item's tokens are consecutive
    output indexes from its first."""

    scheduler_epoch: str
    plan_id: int
    worker_id: str
    handles: list[int]
    token_ids: list[int]
    output_indexes: list[int]
    logprobs: dict[int, tuple[float, tuple]]  # position among the tokens -> (logprob, top logprobs)
    errors: tuple[tuple[int, str, str], ...]  # (handle, code, message) of the items that did not run
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    step_seconds: float  # (several steps: all of them)
    # Whether it wrote its tokens' entries (PlanResult.entries_written), and the handles of the tokens
    # it was to write and did not (several steps: unwritten_tokens).
    entries_written: bool
    unwritten: list[int]
    # The worker's prefix-cache digest after the plan's commands (shared/cache_digest.py); None: not sent.
    cache_digest: int | None = None
    steps: int = 1
    counts: list[int] = field(default_factory=list)  # (several steps) each handle's tokens
    steps_seconds: list[float] = field(default_factory=list)  # (several steps) each step's seconds
    unwritten_tokens: list[int] = field(default_factory=list)  # (several steps) positions among token_ids


def read_result_columns(raw: dict) -> ResultColumns:
    """A worker's answer (as read_result gave it), validated."""
    kind = "PlanResult"
    handles = _int_list(raw, kind, "h", _U16)  # (a uint16 is a handle: the type keeps the range)
    token_ids = _int_list(raw, kind, "t", _I32)
    output_indexes = _int_list(raw, kind, "o", _I32)
    steps = _field(raw, kind, "k", int, 1)
    if not 1 <= steps <= MAX_STEPS:
        raise WireError(f"{kind}: steps {steps} outside [1, {MAX_STEPS}]")
    counts, steps_seconds, unwritten_tokens = [], [], []
    if steps > 1:
        counts = _int_list(raw, kind, "c", np.dtype(np.uint8), 1, steps + 1)
        if len(counts) != len(handles) or sum(counts) != len(token_ids):
            raise WireError(f"{kind}: {len(counts)} counts of {sum(counts)} tokens for {len(handles)} handles, "
                            f"{len(token_ids)} tokens")
        steps_seconds = _field(raw, kind, "ss", list)
        if len(steps_seconds) != steps or not all(isinstance(value, (int, float)) and not isinstance(value, bool)
                                                  and 0 <= value < 1e9 for value in steps_seconds):
            raise WireError(f"{kind}: step times malformed for {steps} steps")
        steps_seconds = [float(value) for value in steps_seconds]
        unwritten_tokens = _int_list(raw, kind, "ep", _U16, 0, len(token_ids))
    elif "c" in raw:  # the answer to one step where an item kept proposed tokens (speculative decoding)
        counts = _int_list(raw, kind, "c", np.dtype(np.uint8), 1, MAX_SPECULATIVE_TOKENS + 2)
        if len(counts) != len(handles) or sum(counts) != len(token_ids):
            raise WireError(f"{kind}: {len(counts)} counts of {sum(counts)} tokens for {len(handles)} handles, "
                            f"{len(token_ids)} tokens")
        unwritten_tokens = _int_list(raw, kind, "ep", _U16, 0, len(token_ids))
    if len(handles) != len(output_indexes) or steps == 1 and not counts and len(handles) != len(token_ids):
        raise WireError(f"{kind}: {len(handles)} handles, {len(token_ids)} tokens, {len(output_indexes)} indexes")
    errors = []
    for entry in _field(raw, kind, "x", list, []):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int)
                and entry[1] in ERROR_CODES and isinstance(entry[2], str)):
            raise WireError(f"{kind}: malformed error entry")
        errors.append((entry[0], entry[1], entry[2][:1000]))
    step_seconds = _field(raw, kind, "s", (int, float))
    if not 0 <= step_seconds < 1e9:
        raise WireError(f"{kind}: step_seconds out of range")
    cache_digest = _field(raw, kind, "cd", int, None) if "cd" in raw else None
    if cache_digest is not None and not 0 <= cache_digest < 2**64:
        raise WireError(f"{kind}: cache digest out of range")
    return ResultColumns(
        scheduler_epoch=_field(raw, kind, "e", str), plan_id=_field(raw, kind, "p", int),
        worker_id=_field(raw, kind, "w", str), handles=handles, token_ids=token_ids, output_indexes=output_indexes,
        logprobs=_logprobs(raw, kind, len(token_ids)) if "l" in raw else {}, errors=tuple(errors),
        kv_blocks_total=_field(raw, kind, "kt", int), kv_blocks_free=_field(raw, kind, "kf", int),
        kv_blocks_cached=_field(raw, kind, "kc", int, 0), step_seconds=float(step_seconds),
        entries_written=_field(raw, kind, "ew", bool, False),
        unwritten=_int_list(raw, kind, "eu", _U16), cache_digest=cache_digest, steps=steps, counts=counts,
        steps_seconds=steps_seconds, unwritten_tokens=unwritten_tokens)


def split_steps(result: ResultColumns) -> list[ResultColumns]:
    """The answer to a plan of several steps as one answer per step, each as the answer to a plan
    of one step would be (plan ids one more each step): step j's tokens are each handle's j-th, its
    errors those of the handles that answered j steps."""
    if result.steps == 1:
        return [result]
    begins = np.cumsum([0, *result.counts]).tolist()
    unwritten, logprobs = set(result.unwritten_tokens), result.logprobs
    errors_at: dict[int, list] = {}
    count_of = dict(zip(result.handles, result.counts))
    for error in result.errors:
        errors_at.setdefault(count_of.get(error[0], 0), []).append(error)
    answers = []
    for step, seconds in enumerate(result.steps_seconds):
        handles, token_ids, output_indexes, step_logprobs, step_unwritten = [], [], [], {}, []
        for handle, count, begin, first in zip(result.handles, result.counts, begins, result.output_indexes):
            if count > step:
                position = begin + step
                if position in logprobs:
                    step_logprobs[len(handles)] = logprobs[position]
                if position in unwritten:
                    step_unwritten.append(handle)
                handles.append(handle)
                token_ids.append(result.token_ids[position])
                output_indexes.append(first + step)
        answers.append(ResultColumns(
            scheduler_epoch=result.scheduler_epoch, plan_id=result.plan_id + step, worker_id=result.worker_id,
            handles=handles, token_ids=token_ids, output_indexes=output_indexes, logprobs=step_logprobs,
            errors=tuple(errors_at.get(step, ())), kv_blocks_total=result.kv_blocks_total,
            kv_blocks_free=result.kv_blocks_free, kv_blocks_cached=result.kv_blocks_cached, step_seconds=seconds,
            entries_written=result.entries_written, unwritten=step_unwritten, cache_digest=result.cache_digest))
    return answers


def read_result(data: bytes) -> tuple[str, dict]:
    """A result's worker id and its fields (read_result_columns reads them)."""
    raw = _unpack("PlanResult", data)
    return _field(raw, "PlanResult", "w", str), raw


def _token_entries(fields: list, kind: str) -> tuple[int, int, tuple[int, ...]]:
    """A new request's (entries_below, first_output_index, text_context): what the worker needs to
    write its token entries (none when the entry has no such fields)."""
    if not fields:
        return 0, 0, ()
    entries_below, first_output_index, context = fields
    if not (isinstance(entries_below, int) and isinstance(first_output_index, int)
            and 0 <= first_output_index <= entries_below < MAX_INDEX and isinstance(context, bytes)
            and len(context) <= 4 * _I32.itemsize):
        raise WireError(f"{kind}: malformed new request (token entries)")
    return entries_below, first_output_index, tuple(_ints({"n": context}, kind, "n", _I32).tolist())


def _logprobs(raw: dict, kind: str, count: int) -> dict[int, tuple[float, tuple]]:
    found = {}
    for entry in _field(raw, kind, "l", list, []):
        try:
            position, logprob, top = entry
            if not (isinstance(position, int) and 0 <= position < count and isinstance(logprob, float)
                    and -1e9 < logprob <= 0 and isinstance(top, list) and len(top) <= 20):
                raise ValueError
            top = tuple((int(token), float(value)) for token, value in top
                        if isinstance(token, int) and isinstance(value, float) and -1e9 < value <= 0)
        except (TypeError, ValueError):
            raise WireError(f"{kind}: malformed logprobs entry") from None
        found[position] = (logprob, top)
    return found


@dataclass(eq=False, slots=True)
class WirePlan:
    """A plan as the wire carries it, validated (read_plan): every request named by its handle, the
    worker's to resolve (services/worker/plan_reader.py keeps the handle table)."""

    epoch: str
    plan_id: int
    worker_id: str
    free_all: bool
    register_handles: list[int]  # blocks to register: the request's handle, the block's index, its hash
    register_indexes: list[int]
    register_hashes: tuple[bytes, ...]
    free_handles: list[int]
    new: list[tuple[int, NewRequest]]  # (handle, the request's data)
    evict_hashes: tuple[bytes, ...]
    decode_handles: list[int]  # decodes that feed the token sampled in the plan before
    decode_outputs: list[int]
    handles: list[int]  # the other items
    starts: list[int]
    counts: list[int]
    samples: list[int]
    outputs: list[int]
    tokens: list[int]  # flattened
    steps: int
    item_steps: list[int]  # in wire order, where they differ (empty: all `steps`)
    answer_with_next: bool
    drafts: list[int] = field(default_factory=list)  # each other item's proposed tokens (empty: none)


def plan_epoch(data: bytes) -> str:
    """The scheduler epoch a plan's bytes carry (WireError: not a plan)."""
    return _field(_unpack("BatchPlan", data), "BatchPlan", "e", str)


def read_plan(data: bytes, worker_id: str) -> WirePlan:
    """A plan's bytes, validated whole before anyone acts on it (a WireError says what is wrong): one
    addressed to another worker, a field of the wrong type or range, columns of different lengths."""
    kind = "BatchPlan"
    raw = _unpack(kind, data)
    if _field(raw, kind, "w", str) != worker_id:
        raise WireError(f"{kind}: addressed to {raw['w']!r}, not to this worker")
    register_handles = _ints(raw, kind, "rh", _U16, 0, MAX_HANDLE + 1)
    register_indexes = _ints(raw, kind, "ri", _I32)
    register_hashes = _hashes(raw.get("rk", b""), kind, "rk")
    if not register_handles.size == register_indexes.size == len(register_hashes):
        raise WireError(f"{kind}: registration fields of different lengths")
    new = []
    for entry in _field(raw, kind, "n", list, []):
        if not (isinstance(entry, list) and len(entry) in (5, 8) and isinstance(entry[0], int)
                and 0 <= entry[0] <= MAX_HANDLE and valid_request_id(entry[1]) and isinstance(entry[2], dict)):
            raise WireError(f"{kind}: malformed new request")
        cached_blocks = _hashes(entry[3], kind, "n")
        cached_token_ids = tuple(_ints({"n": entry[4]}, kind, "n", _I32).tolist())
        entries_below, first_output_index, text_context = _token_entries(entry[5:], kind)
        try:
            sampling = SamplingParams.model_validate(entry[2])
        except Exception as error:  # pydantic's ValidationError: a request's data, once per request
            raise WireError(f"{kind}: new request {entry[1]!r}: {error}") from error
        new.append((entry[0], NewRequest(request_id=entry[1], sampling=sampling, cached_blocks=cached_blocks,
                                         cached_token_ids=cached_token_ids, entries_below=entries_below,
                                         first_output_index=first_output_index, text_context=text_context)))
    decode_handles = _ints(raw, kind, "dh", _U16, 0, MAX_HANDLE + 1)
    decode_outputs = _ints(raw, kind, "do", _I32, 1)
    if decode_handles.size != decode_outputs.size:
        raise WireError(f"{kind}: {decode_handles.size} decode handles, {decode_outputs.size} output indexes")
    handles = _ints(raw, kind, "h", _U16, 0, MAX_HANDLE + 1)
    starts, counts = _ints(raw, kind, "s", _I32), _ints(raw, kind, "c", _I32, 1)
    samples, outputs = _ints(raw, kind, "m", np.dtype(np.uint8), 0, 2), _ints(raw, kind, "o", _I32)
    tokens = _ints(raw, kind, "t", _I32)
    if not handles.size == starts.size == counts.size == samples.size == outputs.size or \
            int(counts.sum()) != tokens.size:
        raise WireError(f"{kind}: item fields of different lengths")
    steps = _field(raw, kind, "k", int, 1)
    if not 1 <= steps <= MAX_STEPS:
        raise WireError(f"{kind}: steps {steps} outside [1, {MAX_STEPS}]")
    item_steps = _ints(raw, kind, "ks", np.dtype(np.uint8), 1, steps + 1).tolist()
    if steps > 1 and not samples.all():
        raise WireError(f"{kind}: a plan of {steps} steps with an item that samples no token")
    if item_steps and len(item_steps) != decode_handles.size + handles.size:
        raise WireError(f"{kind}: {len(item_steps)} item steps for {decode_handles.size + handles.size} items")
    drafts = _ints(raw, kind, "d", np.dtype(np.uint8), 0, MAX_SPECULATIVE_TOKENS + 1)
    if drafts.size and (drafts.size != handles.size or steps > 1 or (drafts >= counts).any()
                        or (drafts.astype(bool) & ~samples.astype(bool)).any()):
        raise WireError(f"{kind}: proposed tokens must be fewer than their item's tokens, on items that sample, "
                        "one per item, in a plan of one step")
    return WirePlan(
        epoch=_field(raw, kind, "e", str), plan_id=_field(raw, kind, "p", int), worker_id=worker_id,
        free_all=_field(raw, kind, "a", bool), register_handles=register_handles.tolist(),
        register_indexes=register_indexes.tolist(), register_hashes=register_hashes,
        free_handles=_ints(raw, kind, "x", _U16, 0, MAX_HANDLE + 1).tolist(), new=new,
        evict_hashes=_hashes(raw.get("ev", b""), kind, "ev"), decode_handles=decode_handles.tolist(),
        decode_outputs=decode_outputs.tolist(), handles=handles.tolist(), starts=starts.tolist(),
        counts=counts.tolist(), samples=samples.tolist(), outputs=outputs.tolist(), tokens=tokens.tolist(),
        steps=steps, item_steps=item_steps, answer_with_next=_field(raw, kind, "g", bool, False),
        drafts=drafts.tolist())


def pack_result(epoch: str, plan_id: int, worker_id: str, handles: Sequence[int], first_indexes: Sequence[int],
                tokens: Sequence[Sequence[int]], errors: list[list], seconds: Sequence[float],
                logprobs: Sequence[tuple[int, int, float, list]], unwritten: Sequence[tuple[int, int]] | None,
                kv_blocks_total: int, kv_blocks_free: int, kv_blocks_cached: int = 0, cache_digest: int = 0) -> bytes:
    """An answer's bytes (ResultColumns says how they read): each answering item's handle, its first
    output index and its tokens (one per step it answered), the errors ([handle, code, message]), each
    step's seconds; logprobs as (item, token of the item, logprob, top), the token entries left unwritten
    as (item, token of the item), None when the worker wrote none; the worker's KV figures after the
    plan's last step and its prefix cache's digest (shared/cache_digest.py)."""
    message = {"f": PLAN_FORMAT, "e": epoch, "p": plan_id, "w": worker_id,
               "h": _array(handles, _U16), "o": _array(first_indexes, _I32), "x": errors,
               "kt": kv_blocks_total, "kf": kv_blocks_free, "kc": kv_blocks_cached, "s": sum(seconds),
               "cd": cache_digest}
    counts = [len(item_tokens) for item_tokens in tokens]
    begins = np.cumsum([0, *counts]).tolist()  # each item's first token's position
    message["t"] = _array([token for item_tokens in tokens for token in item_tokens], _I32)
    several = len(seconds) > 1
    if several:
        message |= {"k": len(seconds), "ss": list(seconds), "c": _array(counts, np.uint8)}
    elif any(count > 1 for count in counts):  # (one step where items kept proposals: speculative decoding)
        message["c"] = _array(counts, np.uint8)
        several = True
    if logprobs:
        message["l"] = [[begins[slot] + at, logprob, top] for slot, at, logprob, top in logprobs]
    if unwritten is not None:
        message["ew"] = True
        if unwritten and not several:
            message["eu"] = _array([handles[slot] for slot, _ in unwritten], _U16)
        elif unwritten:
            message["ep"] = _array([begins[slot] + at for slot, at in unwritten], _U16)
    return msgpack.packb(message, use_bin_type=True)
