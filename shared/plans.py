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
it). `PlanCodec` (the scheduler's, one per worker) hands out the handles; `PlanReader` (the
worker's) keeps them; both start over with a new scheduler epoch or a plan that says free_all.
A plan naming a handle the worker does not hold gets an `unknown_request` error for that item.

Prefix caching adds three fields, all empty when it is off: blocks to register (handles, block
indexes, hashes), hashes of blocks to evict, and on a new request the hashes of the cached blocks
it starts with (hashes are 16 bytes each, concatenated).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from shared.keys import valid_request_id
from shared.messages import (BatchPlan, ItemError, NewRequest, PlanResult, SampledToken, SamplingParams, StepItem,
                             from_fields)
from shared.wire import WireError

PLAN_FORMAT = 2
MAX_HANDLE = 65535  # handles are uint16 on the wire
MAX_INDEX = 2**31
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


class PlanCodec:
    """The scheduler's side, for one worker: plans to bytes, results from bytes."""

    def __init__(self) -> None:
        self.epoch = ""
        self._handle_of: dict[str, int] = {}
        self._request_of: dict[int, str] = {}
        self._free_handles: list[int] = []
        self._next_handle = 0
        # Each plan sent and not answered: its items' handle -> request id. A handle freed by a later
        # plan may name another request by the time the answer comes: it is read as it was sent.
        self._sent: dict[int, dict[int, str]] = {}

    def _reset(self, epoch: str) -> None:
        self.epoch = epoch
        self._handle_of.clear()
        self._request_of.clear()
        self._free_handles.clear()
        self._next_handle = 0
        self._sent.clear()

    def forget(self, plan_id: int) -> None:
        """A plan that will not be answered (its worker went down or it was given up)."""
        self._sent.pop(plan_id, None)

    def encode(self, plan: BatchPlan) -> bytes:
        if plan.scheduler_epoch != self.epoch or plan.free_all:
            self._reset(plan.scheduler_epoch)
        # Registrations name requests this plan may free: their handles are read before the frees.
        registered = [self._handle_of[request_id] for request_id, _, _ in plan.register_blocks]
        freed = []
        for request_id in plan.free_request_ids:
            handle = self._handle_of.pop(request_id, None)
            if handle is not None:
                del self._request_of[handle]
                self._free_handles.append(handle)
                freed.append(handle)
        new = []
        for request in plan.new_requests:
            handle = self._handle_of.get(request.request_id)
            if handle is None:
                if self._free_handles:
                    handle = self._free_handles.pop()
                else:
                    if self._next_handle > MAX_HANDLE:
                        raise ValueError(f"more than {MAX_HANDLE + 1} requests on one worker")
                    handle, self._next_handle = self._next_handle, self._next_handle + 1
                self._handle_of[request.request_id] = handle
                self._request_of[handle] = request.request_id
            entry = [handle, request.request_id, request.sampling.model_dump(mode="python"),
                     b"".join(request.cached_blocks)]
            if request.entries_below:
                entry += [request.entries_below, request.first_output_index, _array(request.text_context, _I32)]
            new.append(entry)
        decode_handles, decode_outputs = [], []
        handles, starts, counts, samples, outputs, tokens = [], [], [], [], [], []
        sent = self._sent[plan.plan_id] = {}
        handle_of = self._handle_of
        for request_id, token_ids, start_position, sample, output_index, feeds_sampled in plan.items:
            handle = handle_of[request_id]
            sent[handle] = request_id
            if feeds_sampled and sample:
                decode_handles.append(handle)
                decode_outputs.append(output_index)
            else:
                handles.append(handle)
                starts.append(start_position)
                counts.append(len(token_ids))
                samples.append(sample)
                outputs.append(output_index)
                tokens.extend(token_ids)
        message = {"f": PLAN_FORMAT, "e": plan.scheduler_epoch, "p": plan.plan_id, "w": plan.worker_id,
                   "a": plan.free_all, "n": new, "x": _array(freed, _U16),
                   "dh": _array(decode_handles, _U16), "do": _array(decode_outputs, _I32)}
        if registered:
            message |= {"rh": _array(registered, _U16), "ri": _array([index for _, index, _ in plan.register_blocks], _I32),
                        "rk": b"".join(block_hash for _, _, block_hash in plan.register_blocks)}
        if plan.evict_blocks:
            message["ev"] = b"".join(plan.evict_blocks)
        if handles:
            message |= {"h": _array(handles, _U16), "s": _array(starts, _I32), "c": _array(counts, _I32),
                        "m": _array(samples, np.uint8), "o": _array(outputs, _I32), "t": _array(tokens, _I32)}
        return msgpack.packb(message, use_bin_type=True)

    def decode_result(self, raw: dict) -> PlanResult:
        """A worker's answer (as read_result gave it), its handles read back as the plan it answers
        named them (an answer to no plan of this codec's, an older epoch's say, comes back with no
        token and no error)."""
        kind = "PlanResult"
        handles = _ints(raw, kind, "h", _U16, 0, MAX_HANDLE + 1)
        token_ids = _ints(raw, kind, "t", _I32)
        output_indices = _ints(raw, kind, "o", _I32)
        if not handles.size == token_ids.size == output_indices.size:
            raise WireError(f"{kind}: {handles.size} handles, {token_ids.size} tokens, {output_indices.size} indexes")
        logprobs = _logprobs(raw, kind, handles.size)
        sent = self._sent.pop(_field(raw, kind, "p", int), {}) if raw.get("e") == self.epoch else {}
        columns = zip(handles.tolist(), token_ids.tolist(), output_indices.tolist())
        if logprobs:
            tokens = []
            for position, (handle, token_id, output_index) in enumerate(columns):
                request_id = sent.get(handle)
                if request_id is not None:
                    logprob, top = logprobs.get(position, (None, ()))
                    tokens.append(SampledToken(request_id, token_id, output_index, logprob, top))
        else:  # (most results: a token and its index per request)
            tokens = [from_fields(SampledToken, (request_id, token_id, output_index, None, ()))
                      for handle, token_id, output_index in columns if (request_id := sent.get(handle)) is not None]
        errors = []
        for entry in _field(raw, kind, "x", list, []):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int)
                    and entry[1] in ERROR_CODES and isinstance(entry[2], str)):
                raise WireError(f"{kind}: malformed error entry")
            request_id = sent.get(entry[0])
            if request_id is not None:
                errors.append(ItemError(request_id=request_id, code=entry[1], message=entry[2][:1000]))
        entries_written = _field(raw, kind, "ew", bool, False)
        unwritten = frozenset(request_id for handle in _ints(raw, kind, "eu", _U16, 0, MAX_HANDLE + 1).tolist()
                              if (request_id := sent.get(handle)) is not None)
        step_seconds = _field(raw, kind, "s", (int, float))
        if not 0 <= step_seconds < 1e9:
            raise WireError(f"{kind}: step_seconds out of range")
        return PlanResult(
            scheduler_epoch=_field(raw, kind, "e", str), plan_id=_field(raw, kind, "p", int),
            worker_id=_field(raw, kind, "w", str), tokens=tuple(tokens), errors=tuple(errors),
            kv_blocks_total=_field(raw, kind, "kt", int), kv_blocks_free=_field(raw, kind, "kf", int),
            kv_blocks_cached=_field(raw, kind, "kc", int, 0), step_seconds=float(step_seconds),
            entries_written=entries_written, unwritten=unwritten)


def read_result(data: bytes) -> tuple[str, dict]:
    """A result's worker id and its fields, for that worker's PlanCodec.decode_result."""
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
            if not (isinstance(entry, list) and len(entry) in (4, 7) and isinstance(entry[0], int)
                    and 0 <= entry[0] <= MAX_HANDLE and valid_request_id(entry[1]) and isinstance(entry[2], dict)):
                raise WireError(f"{kind}: malformed new request")
            cached_blocks = _hashes(entry[3], kind, "n")
            entries_below, first_output_index, text_context = _token_entries(entry[4:], kind)
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
                                  entries_below=entries_below, first_output_index=first_output_index,
                                  text_context=text_context))
        items, item_handles, unknown = [], [], []
        decode_handles = _ints(raw, kind, "dh", _U16, 0, MAX_HANDLE + 1)
        decode_outputs = _ints(raw, kind, "do", _I32, 1)
        if decode_handles.size != decode_outputs.size:
            raise WireError(f"{kind}: {decode_handles.size} decode handles, {decode_outputs.size} output indexes")
        request_of = self._request_of
        for handle, output_index in zip(decode_handles.tolist(), decode_outputs.tolist()):
            request_id = request_of.get(handle)
            if request_id is None:
                unknown.append((handle, "a decode for a handle this worker does not hold"))
                continue
            items.append(from_fields(StepItem, (request_id, (), kv_length(request_id), True, output_index, True)))
            item_handles.append(handle)
        handles = _ints(raw, kind, "h", _U16, 0, MAX_HANDLE + 1)
        starts, counts = _ints(raw, kind, "s", _I32), _ints(raw, kind, "c", _I32, 1)
        samples, outputs = _ints(raw, kind, "m", np.dtype(np.uint8), 0, 2), _ints(raw, kind, "o", _I32)
        tokens = _ints(raw, kind, "t", _I32)
        if not handles.size == starts.size == counts.size == samples.size == outputs.size or \
                int(counts.sum()) != tokens.size:
            raise WireError(f"{kind}: item fields of different lengths")
        ends = np.cumsum(counts).tolist()
        token_list = tokens.tolist()
        for index, (handle, start, sample, output_index) in enumerate(zip(handles.tolist(), starts.tolist(),
                                                                          samples.tolist(), outputs.tolist())):
            request_id = self._request_of.get(handle)
            if request_id is None:
                unknown.append((handle, "an item for a handle this worker does not hold"))
                continue
            begin = ends[index - 1] if index else 0
            items.append(StepItem(request_id=request_id, token_ids=tuple(token_list[begin : ends[index]]),
                                  start_position=start, sample=bool(sample), output_index=output_index))
            item_handles.append(handle)
        self.last_plan_id = plan_id
        plan = BatchPlan(scheduler_epoch=epoch, plan_id=plan_id, worker_id=_field(raw, kind, "w", str),
                         new_requests=tuple(new), items=tuple(items), free_request_ids=tuple(freed), free_all=free_all,
                         register_blocks=tuple(registered), evict_blocks=_hashes(raw.get("ev", b""), kind, "ev"))
        return DecodedPlan(plan, item_handles, unknown)

    def encode_result(self, decoded: DecodedPlan, tokens: dict[str, int], logprobs: dict[str, tuple[float, tuple]],
                      errors: list[tuple[str, str, str]], kv_blocks_total: int, kv_blocks_free: int,
                      step_seconds: float, kv_blocks_cached: int = 0,
                      unwritten: Iterable[str] | None = None) -> bytes:
        """tokens: request id -> token sampled; logprobs: request id -> (logprob, top); errors:
        (request id, code, message) of the items that did not run; unwritten: None when this worker
        wrote no token entry, else the requests whose token entries it was to write and did not."""
        handles, token_ids, output_indices, logprob_entries, unwritten_handles = [], [], [], [], []
        for (request_id, _, _, _, output_index, _), handle in zip(decoded.plan.items, decoded.item_handles):
            token = tokens.get(request_id)
            if token is None:
                continue
            if unwritten and request_id in unwritten:
                unwritten_handles.append(handle)  # (as the plan named it: a later plan may have freed it)
            if logprobs and request_id in logprobs:
                logprob, top = logprobs[request_id]
                logprob_entries.append([len(handles), logprob, [list(pair) for pair in top]])
            handles.append(handle)
            token_ids.append(token)
            output_indices.append(output_index)
        error_entries = [[self._handle_of.get(request_id, MAX_HANDLE), code, message]
                         for request_id, code, message in errors]
        error_entries += [[handle, "unknown_request", message] for handle, message in decoded.unknown]
        message = {"f": PLAN_FORMAT, "e": decoded.plan.scheduler_epoch, "p": decoded.plan.plan_id,
                   "w": decoded.plan.worker_id, "h": _array(handles, _U16), "t": _array(token_ids, _I32),
                   "o": _array(output_indices, _I32), "x": error_entries, "kt": kv_blocks_total, "kf": kv_blocks_free,
                   "kc": kv_blocks_cached, "s": step_seconds}
        if logprob_entries:
            message["l"] = logprob_entries
        if unwritten is not None:
            message["ew"] = True
            if unwritten_handles:
                message["eu"] = _array(unwritten_handles, _U16)
        return msgpack.packb(message, use_bin_type=True)
