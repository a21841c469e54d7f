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
on its side. `PlanReader` (the worker's) keeps the handles; it starts over with a new scheduler
epoch or a plan that says free_all. A plan naming a handle the worker does not hold gets an
`unknown_request` error for that item. (services/bench/by_request_id.py makes the same plans from
BatchPlans, by request id, for tests and tools.)

A plan whose every item samples (decodes, prompts' last chunks) may say it runs several steps
(Settings.scheduler_steps, vLLM v0's multi-step scheduling): the worker runs it, then runs its
items again as decodes that feed the token each sampled, output index and plan id one more each
step, for as many steps as the plan says (each item: `item_steps`, where some run fewer: a request
that reaches its max_tokens), and answers all the steps with one result (StepAnswers): each item's
tokens one after another, with their count. So the scheduler plans, encodes, reads and applies
once for N worker-iterations.

Prefix caching adds three fields, all empty when it is off: blocks to register (handles, block
indexes, hashes), hashes of blocks to evict, and on a new request the hashes of the cached blocks
it starts with (hashes are 16 bytes each, concatenated) and, for a request with penalties only,
the tokens those blocks hold (its penalty history starts with them).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import msgpack
import numpy as np

from shared.keys import valid_request_id
from shared.messages import BatchPlan, NewRequest, SamplingParams, StepItem, from_fields
from shared.wire import WireError

PLAN_FORMAT = 3
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

    @property
    def item_count(self) -> int:
        return len(self.item_ids)

    @property
    def items(self) -> tuple[StepItem, ...]:
        decodes = len(self.decode_handles)
        items = [StepItem(request_id, (), start, True, output_index, True) for request_id, start, output_index
                 in zip(self.item_ids[:decodes], self.decode_starts, self.decode_outputs, strict=True)]
        begin = 0
        for request_id, start, count, sample, output_index in zip(
                self.item_ids[decodes:], self.starts, self.counts, self.samples, self.outputs, strict=True):
            items.append(StepItem(request_id, tuple(self.tokens[begin : begin + count]), start, bool(sample),
                                  output_index))
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
    as one result per step."""

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
    elif "c" in raw:
        raise WireError(f"{kind}: token counts in the answer to one step")
    if len(handles) != len(output_indexes) or steps == 1 and len(handles) != len(token_ids):
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


@dataclass(eq=False)
class DecodedPlan:
    """A plan as the worker reads it: the plan (items with request ids) and the handle of each item."""

    plan: BatchPlan
    item_handles: list[int]
    unknown: list[tuple[int, str]]  # (handle, message) of items naming a handle this worker does not hold
    answer_with_next: bool = False  # its result may wait for the next plan's, to go out with it
    # A plan of several steps (ColumnPlan.steps): which step this is (0: the plan as sent), how many
    # the plan runs and each item's (None: all `steps`).
    step: int = 0
    steps: int = 1
    item_steps: list[int] | None = None


class PlanReader:
    """The worker's side: plans from bytes (each item's request resolved from its handle), results to bytes."""

    def __init__(self) -> None:
        self.epoch = ""
        self.last_plan_id = 0  # of this epoch: plan ids only grow within a scheduler's run
        self._request_of: dict[int, str] = {}
        self._handle_of: dict[str, int] = {}

    def decode(self, data: bytes, kv_length, worker_id: str) -> DecodedPlan | None:
        """kv_length(request_id): the worker's own KV length of a request, a decode item's start
        position (the item feeds the token the worker sampled last; the engine checks its index).
        A plan for another worker is refused before it changes anything. A plan read before (the
        scheduler's Redis client resends a pipeline that failed half-way: its plans come twice) is
        None, before it changes anything: run twice, it would free handles since given to others
        and repeat prefix-cache commands."""
        kind = "BatchPlan"
        raw = _unpack(kind, data)
        if _field(raw, kind, "w", str) != worker_id:
            raise WireError(f"{kind}: addressed to {raw['w']!r}, not to this worker")
        epoch, free_all = _field(raw, kind, "e", str), _field(raw, kind, "a", bool)
        plan_id = _field(raw, kind, "p", int)
        if epoch == self.epoch and plan_id <= self.last_plan_id:
            return None
        if epoch != self.epoch or free_all:
            self.epoch = epoch
            self._request_of.clear()
            self._handle_of.clear()
        register_handles = _ints(raw, kind, "rh", _U16, 0, MAX_HANDLE + 1)
        register_indexes = _ints(raw, kind, "ri", _I32)
        register_hashes = _hashes(raw.get("rk", b""), kind, "rk")
        if not register_handles.size == register_indexes.size == len(register_hashes):
            raise WireError(f"{kind}: registration fields of different lengths")
        # Read before the frees: a request may be registered and freed by one plan. A handle this
        # worker does not hold reads as "" (the worker finds its cache and the scheduler's differ).
        registered = [(self._request_of.get(handle, ""), index, block_hash) for handle, index, block_hash
                      in zip(register_handles.tolist(), register_indexes.tolist(), register_hashes)]
        freed = []
        for handle in _ints(raw, kind, "x", _U16, 0, MAX_HANDLE + 1).tolist():
            request_id = self._request_of.pop(handle, None)
            if request_id is not None:
                self._handle_of.pop(request_id, None)
                freed.append(request_id)
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
            handle, request_id = entry[0], entry[1]
            stale = self._request_of.get(handle)
            if stale is not None and stale != request_id:
                self._handle_of.pop(stale, None)
            self._request_of[handle] = request_id
            self._handle_of[request_id] = handle
            new.append(NewRequest(request_id=request_id, sampling=sampling, cached_blocks=cached_blocks,
                                  cached_token_ids=cached_token_ids, entries_below=entries_below,
                                  first_output_index=first_output_index,
                                  text_context=text_context))
        items, item_handles, unknown = [], [], []
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
        wire_steps = _ints(raw, kind, "ks", np.dtype(np.uint8), 1, steps + 1).tolist()
        if steps > 1 and not samples.all():
            raise WireError(f"{kind}: a plan of {steps} steps with an item that samples no token")
        if wire_steps and len(wire_steps) != decode_handles.size + handles.size:
            raise WireError(f"{kind}: {len(wire_steps)} item steps for {decode_handles.size + handles.size} items")
        request_of = self._request_of
        item_steps = [] if wire_steps else None  # each decoded item's, where they differ
        for position, (handle, output_index) in enumerate(zip(decode_handles.tolist(), decode_outputs.tolist())):
            request_id = request_of.get(handle)
            if request_id is None:
                unknown.append((handle, "a decode for a handle this worker does not hold"))
                continue
            if wire_steps:
                item_steps.append(wire_steps[position])
            items.append(from_fields(StepItem, (request_id, (), kv_length(request_id), True, output_index, True)))
            item_handles.append(handle)
        ends = np.cumsum(counts).tolist()
        token_list = tokens.tolist()
        for index, (handle, start, sample, output_index) in enumerate(zip(handles.tolist(), starts.tolist(),
                                                                          samples.tolist(), outputs.tolist())):
            request_id = self._request_of.get(handle)
            if request_id is None:
                unknown.append((handle, "an item for a handle this worker does not hold"))
                continue
            if wire_steps:
                item_steps.append(wire_steps[decode_handles.size + index])
            begin = ends[index - 1] if index else 0
            items.append(StepItem(request_id=request_id, token_ids=tuple(token_list[begin : ends[index]]),
                                  start_position=start, sample=bool(sample), output_index=output_index))
            item_handles.append(handle)
        self.last_plan_id = plan_id + steps - 1  # (the later steps' results answer the ids after it)
        plan = BatchPlan(scheduler_epoch=epoch, plan_id=plan_id, worker_id=_field(raw, kind, "w", str),
                         new_requests=tuple(new), items=tuple(items), free_request_ids=tuple(freed), free_all=free_all,
                         register_blocks=tuple(registered), evict_blocks=_hashes(raw.get("ev", b""), kind, "ev"))
        return DecodedPlan(plan, item_handles, unknown, _field(raw, kind, "g", bool, False), steps=steps,
                           item_steps=item_steps)

    @staticmethod
    def next_step(decoded: DecodedPlan, kv_length) -> DecodedPlan | None:
        """A plan of several steps: its next step, once the step before has run (None after its last):
        the items that run it, each a decode feeding the token it sampled in the step before
        (kv_length as for decode), under the next plan id; its unknown handles were answered with
        the first step. (The plan's answer holds every step's: StepAnswers.)"""
        step = decoded.step + 1
        if step >= decoded.steps:
            return None
        plan, item_steps = decoded.plan, decoded.item_steps
        kept = [(item, handle) for item, handle, count in zip(plan.items, decoded.item_handles,
                                                              item_steps or repeat(decoded.steps)) if count > step]
        items = tuple([from_fields(StepItem, (item.request_id, (), kv_length(item.request_id), True,
                                              item.output_index + 1, True)) for item, _ in kept])
        return DecodedPlan(
            BatchPlan(scheduler_epoch=plan.scheduler_epoch, plan_id=plan.plan_id + 1, worker_id=plan.worker_id,
                      items=items),
            [handle for _, handle in kept], [], decoded.answer_with_next, step=step, steps=decoded.steps,
            item_steps=None if item_steps is None else [count for count in item_steps if count > step])

    def encode_result(self, decoded: DecodedPlan, tokens: dict[str, int], logprobs: dict[str, tuple[float, tuple]],
                      errors: list[tuple[str, str, str]], kv_blocks_total: int, kv_blocks_free: int,
                      step_seconds: float, kv_blocks_cached: int = 0,
                      unwritten: Iterable[str] | None = None, cache_digest: int = 0) -> bytes:
        """The answer to a plan of one step (StepAnswers: of any), as StepAnswers.add takes it."""
        answers = StepAnswers(self)
        answers.add(decoded, tokens, logprobs, errors, step_seconds, unwritten)
        return answers.packed(kv_blocks_total, kv_blocks_free, kv_blocks_cached, cache_digest)


class StepAnswers:
    """A plan's answer, gathered as its steps run (one, or several: PlanReader.next_step) and packed
    as one result (ResultColumns says how one of several steps reads): each item's tokens in order
    from the first step, until a step it has no token in (an error)."""

    def __init__(self, reader: PlanReader) -> None:
        self.reader = reader
        self._first: DecodedPlan | None = None
        self._slot_of: dict[int, int] = {}  # handle -> its slot: its place among the answer's items
        self._open: list[bool] = []  # each slot: answered every step so far
        self.handles: list[int] = []
        self.first_indexes: list[int] = []
        self.tokens: list[list[int]] = []  # each slot's
        self.logprobs: list[tuple[int, int, float, list]] = []  # (slot, its token's, logprob, top)
        self.unwritten: list[tuple[int, int]] = []  # (slot, its token's)
        self.entries_written = False
        self.errors: list[list] = []
        self._erred: set[int] = set()  # handles answered with an error
        self.seconds: list[float] = []

    def add(self, decoded: DecodedPlan, tokens: dict[str, int], logprobs: dict[str, tuple[float, tuple]],
            errors: list[tuple[str, str, str]], step_seconds: float, unwritten: Iterable[str] | None = None) -> None:
        """A step's outcome: tokens: request id -> token sampled; logprobs: request id -> (logprob,
        top); errors: (request id, code, message) of the items that did not run; unwritten: None when
        this worker wrote no token entry, else the requests whose token entries it was to write and
        did not."""
        first = self._first is None
        if first:
            self._first = decoded
        slot_of, is_open = self._slot_of, self._open
        for (request_id, _, _, _, output_index, _), handle in zip(decoded.plan.items, decoded.item_handles):
            token = tokens.get(request_id)
            slot = slot_of.get(handle)
            if token is None or not (first or slot is not None and is_open[slot]):
                if slot is not None:
                    is_open[slot] = False  # (its tokens stop at the step before)
                continue
            if slot is None:
                slot = slot_of[handle] = len(self.handles)
                self.handles.append(handle)
                self.first_indexes.append(output_index)
                self.tokens.append([])
                is_open.append(True)
            if unwritten and request_id in unwritten:
                self.unwritten.append((slot, len(self.tokens[slot])))
            if logprobs and request_id in logprobs:
                logprob, top = logprobs[request_id]
                self.logprobs.append((slot, len(self.tokens[slot]), logprob, [list(pair) for pair in top]))
            self.tokens[slot].append(token)
        handle_of = self.reader._handle_of
        for request_id, code, message in errors:
            handle = handle_of.get(request_id, MAX_HANDLE)
            if handle not in self._erred:  # (the first error of an item: its later steps had nothing to feed)
                self._erred.add(handle)
                self.errors.append([handle, code, message])
        if first:
            self.errors += [[handle, "unknown_request", message] for handle, message in decoded.unknown]
        self.entries_written = self.entries_written or unwritten is not None
        self.seconds.append(step_seconds)

    @property
    def plan(self) -> BatchPlan:
        """The plan answered (as its first step runs it)."""
        return self._first.plan

    def packed(self, kv_blocks_total: int, kv_blocks_free: int, kv_blocks_cached: int = 0,
               cache_digest: int = 0) -> bytes:
        """The result on the wire (after the plan's last step: the KV figures are its)."""
        plan = self.plan
        message = {"f": PLAN_FORMAT, "e": plan.scheduler_epoch, "p": plan.plan_id, "w": plan.worker_id,
                   "h": _array(self.handles, _U16), "o": _array(self.first_indexes, _I32), "x": self.errors,
                   "kt": kv_blocks_total, "kf": kv_blocks_free, "kc": kv_blocks_cached, "s": sum(self.seconds),
                   "cd": cache_digest}
        counts = [len(tokens) for tokens in self.tokens]
        begins = np.cumsum([0, *counts]).tolist()  # each slot's first token's position
        message["t"] = _array([token for tokens in self.tokens for token in tokens], _I32)
        if len(self.seconds) > 1:
            message |= {"k": len(self.seconds), "ss": self.seconds, "c": _array(counts, np.uint8)}
        if self.logprobs:
            message["l"] = [[begins[slot] + at, logprob, top] for slot, at, logprob, top in self.logprobs]
        if self.entries_written:
            message["ew"] = True
            if self.unwritten and len(self.seconds) == 1:
                message["eu"] = _array([self.handles[slot] for slot, _ in self.unwritten], _U16)
            elif self.unwritten:
                message["ep"] = _array([begins[slot] + at for slot, at in self.unwritten], _U16)
        return msgpack.packb(message, use_bin_type=True)
