"""Batched next-token sampling: one call picks the next token of every row of a step, on the
logits' device, with no Python loop over rows on the hot path. It replaced a per-row sampler on
the host (kept for comparison in benchmarks/per_row_sampler.py).

Semantics, in this order (a stage runs only when some row needs it, and only on those rows):
0. Adjustments (LogitAdjustments): a constraint's mask sends the tokens it does not allow to -inf,
   then OpenAI's logit_bias is added.
1. Penalties, on float32 logits, in vLLM's order: repetition (HF/vLLM: a token seen in the
   prompt or the output has its logit divided by r when > 0, multiplied by r otherwise), then
   frequency (logit -= f * count) and presence (logit -= p * (count > 0)), where count is the
   token's count in the output only (OpenAI, vLLM).
2. Greedy rows (temperature 0): argmax of the penalized logits, the first maximum; no randomness.
3. Other rows: logits / temperature, then
   min_p: drop tokens whose probability is below min_p x the row's top probability, decided in
     logit space (logit < max + log(min_p));
   top_k: keep the k largest logits;
   top_p: keep the smallest set of most probable tokens whose mass, in the distribution
     renormalized after min_p and top_k, reaches top_p (the token that crosses top_p is kept,
     so at least one token always is).
   Ties go together: top_k keeps every token >= the k-th largest logit, and top_p keeps a token
   iff the mass strictly above its probability is below top_p. So the kept set depends on the
   values only, never on the order some kernel broke ties in.
4. The draw, from the kept set renormalized.
Logprobs, when asked, are log_softmax of the raw logits (before penalties, temperature and
truncation), what vLLM returns by default.

Randomness is counter-based: a row's draws depend on (seed, output_index) only, through an
integer hash computed with int64 torch ops on the device (lowbias32 rounds in a two-lane
Feistel network, every product below 2**63). Never on the other rows, the batch size, the row's
position, the device or a global RNG: a request samples the same tokens in any batch, on any
worker, and after its KV is rebuilt.

A draw is an inverse CDF in vocabulary order: a uniform u picks the first token whose cumulative
weight exceeds u x the total weight. The sums that decide anything are int64 fixed point
(weights scaled by a power of two and truncated), exact whatever order a kernel adds in; the
float work before them is elementwise or within a row (softmax, sums of 64-token blocks). So a
row's path and result are functions of its own logits and parameters: batch-invariant.

Two paths, chosen by a row's own parameters (so a row always takes the same one):
- top_k rows: the top k + 1 logits (more only when ties run past the k-th), then min_p, top_p
  and the draw on those candidates alone.
- the other rows: softmax of the whole row and a blocked inverse CDF (which 64-token block,
  then which token in it). top_p by rejection, without sorting: draw from the row; a drawn
  token is in the nucleus iff the mass strictly above it is below top_p x the kept mass; if it
  is not, no token at or below its probability is either, so those are dropped and the row
  draws again with the next uniform of its counter stream. The nucleus is never cut, so the
  accepted token follows the renormalized nucleus exactly. A first draw is accepted with
  probability >= top_p, and a token above 1 - top_p is accepted without looking further.
  Why not sort: on real logits at temperature 1 the 0.95 nucleus holds hundreds to thousands
  of tokens (median ~260 for SmolLM2-135M), so topk candidates would have to widen to
  thousands (topk k=1024 on [64, 49152]: ~15 ms on 2 CPU threads; a full sort: ~115 ms),
  while a rejection round costs a few elementwise passes over the rows that need it.

On the CPU, measured on [64, 49152] with 2 threads: comparisons (bool results) and where()
cost 3 to 15 times more than a float op (0.7 to 2.7 ms against ~0.2), so masks are float ops:
F.threshold_ after a subtraction or a division (exact comparisons, see _mass_above), or
sign(relu(a - b)); torch.argmax and torch.topk lose to 64-token-block versions built on
amax; and the [rows, V] intermediates live in reused buffers (Workspace), as fresh multi-MB
tensors cost page faults.
"""

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 64  # tokens per block: blocked inverse CDF, argmax and topk
PROBABILITY_BITS = 52  # fixed point of probabilities (sums <= ~1: exact in float64 too)
WEIGHT_BITS = 40  # fixed point of candidate weights exp(logit - max) <= 1 (sums <= V * 2**40)
MAX_TOP_LOGPROBS = 20
# A temperature below this is greedy (vLLM's threshold): dividing by it would overflow the logits
# to infinity, and nothing but the top token could be drawn anyway.
GREEDY_BELOW = 1e-5
MAX_REJECTION_ROUNDS = 1 << 16  # never reached with finite logits: each round drops >= 1 token
PRECOMPUTED_STREAMS = 4  # a draw and 3 rejection rounds (one is typical for a 64-row step)
_MASK32 = 0xFFFFFFFF


# Per-row parameters


@dataclass(frozen=True)
class _Rows:
    """Some rows of the batch (or of a group): their indices on the device, or None when they
    are all the rows, in order (then nothing is gathered)."""

    index: torch.Tensor | None
    count: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.index is None else tensor.index_select(0, self.index)


def _rows(mask: np.ndarray, device: torch.device) -> _Rows | None:
    """The rows where a host-side boolean mask over a batch (or a group) holds."""
    positions = np.flatnonzero(mask)
    if not positions.size:
        return None
    if positions.size == mask.size:
        return _Rows(None, positions.size)
    return _Rows(torch.from_numpy(positions).to(device, non_blocking=True), positions.size)


@dataclass(frozen=True)
class _Group:
    """Sampled rows that take one path, and which of its stages they need."""

    rows: _Rows  # in the batch
    unit_temperature: bool  # every row has temperature 1: no division (x / 1 == x)
    min_p: _Rows | None  # rows of the group with min_p > 0
    top_p: _Rows | None  # rows of the group with top_p < 1
    max_top_k: int


@dataclass(frozen=True)
class _Plan:
    """Row subsets of each stage, for one vocabulary size."""

    greedy: _Rows | None
    top_k: _Group | None  # 0 < top_k < V
    full: _Group | None  # the other sampled rows
    penalty: _Rows | None
    repetition: bool  # some penalty row has repetition_penalty != 1
    frequency: bool
    presence: bool
    logprobs: _Rows | None


# Field -> value when a params object lacks it (SamplingParams before min_p and the rest).
_DEFAULTS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
             "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": 0, "logprobs": -1}
_INTEGER_FIELDS = ("top_k", "seed", "output_index", "logprobs")


@dataclass
class SamplingRows:
    """Per-row sampling parameters of one step, as tensors on the logits' device, plus host-side
    summaries (plain Python values) so the sampler can skip stages and pick row subsets without
    a device sync. Build with from_params."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    presence_penalty: torch.Tensor  # [B] float32, 0 = off (OpenAI semantics, range [-2, 2])
    frequency_penalty: torch.Tensor  # [B] float32, 0 = off
    repetition_penalty: torch.Tensor  # [B] float32, 1 = off (HF/vLLM semantics, > 0)
    seed: torch.Tensor  # [B] int64 in [0, 2**63)
    output_index: torch.Tensor  # [B] int64 in [0, 2**31): index of the token being sampled
    logprobs: torch.Tensor  # [B] int64: -1 none; n >= 0 the chosen token's log-probability and n top ones
    # Host side: every parameter as a numpy array (the plans' source: row subsets by vectorized
    # masks, no Python per row), and summaries.
    host: dict[str, np.ndarray] = field(repr=False)
    all_greedy: bool
    any_top_k: bool
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    max_logprobs: int  # the most top logprobs a row asks for (-1: no row asks), capped at MAX_TOP_LOGPROBS
    _plans: dict[int, _Plan] = field(default_factory=dict, repr=False)
    _keys: torch.Tensor | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.host["temperature"])

    @classmethod
    def from_params(cls, params: Sequence[Any], output_indices: Sequence[int],
                    device: torch.device | str = "cpu", vocab_size: int | None = None) -> "SamplingRows":
        """Rows from SamplingParams-like objects (a field the object lacks reads as off) and the
        output index of the token each row samples. vocab_size, when known, plans the row
        subsets now rather than at the first sample() call."""
        if len(params) != len(output_indices):
            raise ValueError("one output index per row")
        host: dict[str, list] = {name: [] for name in (*_DEFAULTS, "output_index")}
        for request, output_index in zip(params, output_indices):
            values = {name: getattr(request, name, default) for name, default in _DEFAULTS.items()}
            values["output_index"] = output_index
            values["logprobs"] = max(-1, values["logprobs"])  # SamplingParams: -1 none, n >= 0 chosen + n top
            _check(values)
            if values["temperature"] < GREEDY_BELOW:
                values["temperature"] = 0.0
            for name, value in values.items():
                host[name].append(value)
        device = torch.device(device)
        arrays = {name: np.asarray(values, dtype=np.int64 if name in _INTEGER_FIELDS else np.float32)
                  for name, values in host.items()}
        tensors = {name: torch.from_numpy(array).to(device) for name, array in arrays.items()}
        rows = cls(**tensors, host=arrays,
                   all_greedy=bool((arrays["temperature"] == 0).all()),
                   any_top_k=bool((arrays["top_k"] > 0).any()),
                   max_top_k=int(arrays["top_k"].max(initial=0)),
                   any_top_p=bool((arrays["top_p"] < 1).any()),
                   any_min_p=bool((arrays["min_p"] > 0).any()),
                   any_penalty=bool(_penalty_mask(arrays).any()),
                   max_logprobs=min(MAX_TOP_LOGPROBS, int(arrays["logprobs"].max(initial=-1))))
        if vocab_size is not None:
            rows.plan(vocab_size)
        return rows

    def seed_keys(self) -> torch.Tensor:
        """[B, 2] hashed seeds (see seed_keys()), computed on first use."""
        if self._keys is None:
            self._keys = seed_keys(self.seed)
        return self._keys

    def plan(self, vocab_size: int) -> _Plan:
        """The row subsets of each stage (vectorized masks over the host arrays: once per rows and V)."""
        if vocab_size not in self._plans:
            self._plans[vocab_size] = self._make_plan(vocab_size)
        return self._plans[vocab_size]

    def _make_plan(self, vocab_size: int) -> _Plan:
        host, device = self.host, self.seed.device
        temperature, top_k = host["temperature"], host["top_k"]
        sampled = temperature > 0
        # top_k >= V keeps everything: such a row is a no-top-k row, whatever k it names.
        cut = sampled & (top_k > 0) & (top_k < vocab_size)
        penalty = _penalty_mask(host)

        def group(members: np.ndarray) -> _Group | None:
            rows = _rows(members, device)
            if rows is None:
                return None
            return _Group(rows, unit_temperature=bool((temperature[members] == 1).all()),
                          min_p=_rows(host["min_p"][members] > 0, device),
                          top_p=_rows(host["top_p"][members] < 1, device),
                          max_top_k=int(top_k[members].max()))

        return _Plan(greedy=_rows(~sampled, device), top_k=group(cut), full=group(sampled & ~cut),
                     penalty=_rows(penalty, device),
                     repetition=bool((host["repetition_penalty"][penalty] != 1).any()),
                     frequency=bool((host["frequency_penalty"][penalty] != 0).any()),
                     presence=bool((host["presence_penalty"][penalty] != 0).any()),
                     logprobs=_rows(host["logprobs"] >= 0, device))


def _penalty_mask(host: dict[str, np.ndarray]) -> np.ndarray:
    return (host["presence_penalty"] != 0) | (host["frequency_penalty"] != 0) | (host["repetition_penalty"] != 1)


def _check(values: dict) -> None:
    problems = []
    if not 0 <= values["temperature"] < math.inf:
        problems.append("temperature must be >= 0")
    if not 0 < values["top_p"] <= 1:
        problems.append("top_p must be in (0, 1]")
    if values["top_k"] < 0:
        problems.append("top_k must be >= 0")
    if not 0 <= values["min_p"] <= 1:
        problems.append("min_p must be in [0, 1]")
    if not 0 < values["repetition_penalty"] < math.inf:
        problems.append("repetition_penalty must be > 0")
    if not (math.isfinite(values["presence_penalty"]) and math.isfinite(values["frequency_penalty"])):
        problems.append("presence and frequency penalties must be finite")
    if not 0 <= values["seed"] < 2**63:
        problems.append("seed must be in [0, 2**63)")
    if not 0 <= values["output_index"] < 2**31:
        problems.append("output_index must be in [0, 2**31)")
    if problems:
        raise ValueError("; ".join(problems))


# Reused buffers


class Workspace:
    """Buffers reused from call to call, one per role name, grown to the largest step seen.

    On the CPU a fresh multi-MB tensor per call costs page faults (glibc hands big freed blocks
    back to the OS): 5 to 20 ms a call were measured on [64, 49152], several times the
    sampling itself. So the [rows, V] intermediates live here, at most 6 buffers of [B, V]
    (2 for temperature alone, 4 with top_p). With reuse=False each take is a fresh tensor:
    the default off the CPU, where the caching allocator already reuses memory. Not
    thread-safe: sample() keeps one per thread."""

    def __init__(self, reuse: bool = True):
        self.reuse = reuse
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if not self.reuse:
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)


_per_thread = threading.local()


def _workspace(device: torch.device, given: Workspace | None) -> Workspace:
    if given is not None:
        return given
    if device.type != "cpu":
        return Workspace(reuse=False)
    if not hasattr(_per_thread, "workspace"):
        _per_thread.workspace = Workspace()
    return _per_thread.workspace


def _gather(x: torch.Tensor, rows: _Rows, name: str, workspace: Workspace) -> torch.Tensor:
    """The given rows of x: x itself when they are all its rows, else a workspace buffer."""
    if rows.index is None:
        return x
    return torch.index_select(x, 0, rows.index, out=workspace.take(name, (rows.count, x.shape[1]), x.dtype, x.device))


def _greater(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Float 1.0 where a > b, else 0.0, without a bool tensor (3 to 10 times slower here):
    a - b > 0 exactly when a > b (no float subtraction of different values gives 0)."""
    return torch.sub(a, b, out=out).clamp_(min=0).sign_()


# Penalty history


@dataclass
class PenaltyHistory:
    """Each row's prompt and output token ids so far, padded with -1 (rows without penalties
    may be left empty). Only the penalty rows are read, at sample time."""

    prompt_ids: torch.Tensor  # [B, Lp] int64
    output_ids: torch.Tensor  # [B, Lo] int64

    @classmethod
    def from_lists(cls, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                   device: torch.device | str = "cpu") -> "PenaltyHistory":
        if len(prompt_ids) != len(output_ids):
            raise ValueError("one prompt and one output per row")
        return cls(_padded(prompt_ids, device), _padded(output_ids, device))


def _padded(rows: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    width = max((len(ids) for ids in rows), default=0)
    return torch.tensor([list(ids) + [-1] * (width - len(ids)) for ids in rows], dtype=torch.long,
                        device=device).view(len(rows), width)


def apply_penalties(logits: torch.Tensor, rows: SamplingRows, history: PenaltyHistory | None,
                    workspace: Workspace | None = None) -> torch.Tensor:
    """[B, V] logits -> float32 logits, each penalty row's penalties applied, the other rows
    unchanged: a new tensor (a workspace buffer when one is given), or logits.float() when no
    row has penalties.

    Only the seen tokens change, so the work is gathers and scatters at the rows' token ids
    ([P, L]), not passes over [P, V]: a padding entry (or a repeated id) points at a column
    whose new value it computes exactly as a real entry for that column would, so scattering
    duplicates writes one value."""
    count, vocab_size = logits.shape
    plan = rows.plan(vocab_size)
    if plan.penalty is None:
        return logits.float()
    if history is None:
        raise ValueError("penalties need a PenaltyHistory")
    workspace = workspace or Workspace(reuse=False)
    penalty, device = plan.penalty, logits.device
    take = penalty.take
    out = workspace.take("penalized", (count, vocab_size), torch.float32, device)
    out.copy_(logits)
    flat = out.view(-1)
    row_start = (penalty.index if penalty.index is not None else torch.arange(count, device=device)) * vocab_size
    row_start = row_start.unsqueeze(1)
    ids = torch.cat([take(history.prompt_ids), take(history.output_ids)], dim=1)
    if plan.repetition and ids.shape[1]:
        # Padding takes the row's first id; a row without ids divides and multiplies by 1.
        first = ids.gather(1, (ids >= 0).to(torch.uint8).argmax(1, keepdim=True))
        factor = torch.where(first >= 0, take(rows.repetition_penalty).unsqueeze(1), 1.0)
        positions = row_start + torch.where(ids >= 0, ids, first.clamp(min=0))
        values = flat.gather(0, positions.view(-1)).view(positions.shape)
        flat.scatter_(0, positions.view(-1), torch.where(values > 0, values / factor, values * factor).view(-1))
    if plan.frequency or plan.presence:
        ids = take(history.output_ids)
        columns = ids.clamp(min=0)  # padding -> column 0, with column 0's true count (maybe 0)
        counts = workspace.take("scratch1", (penalty.count, vocab_size), torch.float32, device).zero_()
        counts = counts.scatter_add_(1, columns, (ids >= 0).to(torch.float32)).gather(1, columns)
        positions = (row_start + columns).view(-1)
        values = flat.gather(0, positions).view(columns.shape)
        if plan.frequency:
            values = values - take(rows.frequency_penalty).unsqueeze(1) * counts
        if plan.presence:
            values = values - take(rows.presence_penalty).unsqueeze(1) * (counts > 0).to(torch.float32)
        flat.scatter_(0, positions, values.view(-1))
    return out


# Counter-based randomness


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2**32 for x in [0, 2**32), every intermediate below 2**63: a constant
    >= 2**31 is split as c + 2**31, whose x * 2**31 term mod 2**32 is the low bit of x, moved up."""
    if constant < 2**31:
        return (x * constant) & _MASK32
    return (x * (constant - 2**31) + ((x & 1) << 31)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (from Wellons' hash prospector): a bijection of 32-bit values with full
    avalanche. Values stay in [0, 2**32), so >> on int64 is a logical shift here."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_keys(seed: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds in [0, 2**63) -> [R, 2] 32-bit lanes: two Feistel half-rounds (each
    xors one lane with lowbias32 of the other) over the seed's halves. A bijection, so two
    seeds never share a key. Computed once per SamplingRows."""
    low, high = seed & _MASK32, (seed >> 32) & _MASK32
    high = high ^ _mix32(low ^ 0x9E3779B9)
    low = low ^ _mix32(high ^ 0x85EBCA6B)
    return torch.stack([low, high], dim=1)


def _uniforms(keys: torch.Tensor, output_index: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """The output index enters one lane and the stream the other, then three half-rounds mix
    both into both (a bijection of the 64-bit state for a given key). stream: an int ([R]
    uniforms) or an [S] int64 tensor ([R, S]: several streams of each row for the ops' cost of
    one, each value the one the stream alone gives)."""
    a = keys[:, 0] ^ (output_index & _MASK32)
    b = keys[:, 1]
    if isinstance(stream, torch.Tensor):
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    b = b ^ ((stream * 0x2545F491 + 0x68E31DA4) & _MASK32)
    b = b ^ _mix32(a)
    a = a ^ _mix32(b)
    b = b ^ _mix32(a)
    bits = (a << 20) | (b >> 12)  # 32 + 20 bits
    return (bits.to(torch.float64) + 0.5) * 2.0**-52


def uniforms(seed: torch.Tensor, output_index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """[R] int64 seeds and output indices -> [R] float64 uniforms in (0, 1) with 52 random bits,
    a function of (seed, output_index, stream) only. Stream 0 is a row's draw; top_p's
    rejection rounds use streams 1, 2, ..."""
    return _uniforms(seed_keys(seed), output_index, stream)


# Draws


def _fixed(weights: torch.Tensor, bits: int) -> torch.Tensor:
    """Nonnegative float weights -> int64 fixed point (scaling by a power of two is exact; the
    conversion truncates)."""
    return (weights * float(2**bits)).to(torch.long)


def _target(u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """[R] uniforms, [R] int64 totals >= 1 -> int64 targets in [0, total)."""
    target = (u * total.to(torch.float64)).floor().to(torch.long)
    return torch.minimum(target, total - 1)


def _first_above(ends: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[R, N] nondecreasing cumulative sums, [R] targets -> index of the first end > target
    (one binary search per row: a comparison and a sum over [R, N] cost several times more)."""
    return torch.searchsorted(ends, target.unsqueeze(1), right=True).squeeze(1)


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """[R, W] float32 weights (W a multiple of BLOCK) -> [R, W / BLOCK] float32 block sums. Each
    float sum covers one block within one row: the same whatever the batch. A sum is at least
    each of its (nonnegative) terms, since rounding is monotone: fl(a + b) >= max(a, b)."""
    return weights.view(weights.shape[0], -1, BLOCK).sum(2)


def _draw_blocked(weights: torch.Tensor, u: torch.Tensor,
                  block_sums: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, W] float32 weights >= 0, W a multiple of BLOCK, total <= ~1 -> ([R] token ids,
    [R] int64 fixed-point totals), by inverse CDF in vocabulary order: the block, from the
    cumulative fixed-point block masses, then the token, from the block's own fixed-point weights
    (the target rescaled to their sum, which differs from the block's float sum by rounding).
    block_sums: _block_sums(weights), when the caller has them."""
    count = weights.shape[0]
    block_mass = _fixed(_block_sums(weights) if block_sums is None else block_sums, PROBABILITY_BITS)
    ends = block_mass.cumsum(1)
    total = ends[:, -1]
    target = _target(u, total)
    block = _first_above(ends, target).unsqueeze(1)
    mass = block_mass.gather(1, block).squeeze(1)
    offset = (target - (ends.gather(1, block).squeeze(1) - mass)).to(torch.float64) / mass.to(torch.float64)
    inner = weights.view(count, -1, BLOCK).gather(1, block.unsqueeze(2).expand(count, 1, BLOCK)).squeeze(1)
    inner_ends = _fixed(inner, PROBABILITY_BITS).cumsum(1)
    inner_total = inner_ends[:, -1]
    position = _first_above(inner_ends, _target(offset, inner_total.clamp(min=1)))
    # A block whose weights all truncate to 0 (each < 2**-52, so drawn with probability
    # < 2**-46): its largest token, which has weight > 0.
    position = torch.where(inner_total > 0, position, inner.argmax(1))
    return block.squeeze(1) * BLOCK + position, total


def _draw_sorted_ids(ids: torch.Tensor, weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R, N] candidate ids, int64 weights (0: not kept) -> [R] ids, by inverse CDF in
    vocabulary order (the candidates' own order depends on how topk broke ties)."""
    ids, order = ids.sort(1)
    ends = weights.gather(1, order).cumsum(1)
    return ids.gather(1, _first_above(ends, _target(u, ends[:, -1])).unsqueeze(1)).squeeze(1)


def _blockwise(width: int, count: int) -> bool:
    """Whether a [., width] row splits into blocks with enough of them to beat the plain op."""
    return width % BLOCK == 0 and count * BLOCK * 4 <= width


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, 1), the first maximum, by 64-token blocks: amax is a plain
    vectorized reduction and argmax is not (0.25 ms against 1.3 ms on [64, 49152]). Rows
    holding NaN may differ from torch.argmax."""
    count, width = logits.shape
    if not _blockwise(width, 1):
        return logits.argmax(1)
    blocks = logits.view(count, -1, BLOCK)
    block_max = blocks.amax(2)
    block = (block_max == block_max.amax(1, keepdim=True)).to(torch.uint8).argmax(1, keepdim=True)
    inner = blocks.gather(1, block.unsqueeze(2).expand(count, 1, BLOCK)).squeeze(1)
    return block.squeeze(1) * BLOCK + inner.argmax(1)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) along rows (values descending), by blocks when that pays: the k largest
    values sit in the k blocks with the largest maxima (a value outside them has k block maxima
    at least as large above it), so topk runs on [R, V / 64] maxima and then on k * 64
    candidates (0.5 ms against 2.3 ms for k = 51 on [64, 49152]). The values are torch.topk's;
    which of equal values come out can differ."""
    count, width = x.shape
    if not _blockwise(width, k):
        return x.topk(k, dim=1)
    blocks = x.view(count, -1, BLOCK)
    chosen = blocks.amax(2).topk(k, dim=1).indices
    pool = blocks.gather(1, chosen.unsqueeze(2).expand(count, k, BLOCK)).view(count, k * BLOCK)
    values, position = pool.topk(k, dim=1)
    return values, chosen.gather(1, position // BLOCK) * BLOCK + position % BLOCK


def _scaled(x: torch.Tensor, temperature: torch.Tensor, unit: bool, width: int, workspace: Workspace) -> torch.Tensor:
    """float32 x / temperature, padded with -inf to `width` columns: x itself when that changes
    nothing (not to be modified then), else a workspace buffer."""
    count, vocab_size = x.shape
    if unit and width == vocab_size and x.dtype == torch.float32:
        return x
    out = workspace.take("scaled", (count, width), torch.float32, x.device)
    body = out[:, :vocab_size] if width > vocab_size else out
    if unit:
        body.copy_(x)
    else:
        torch.div(x, temperature.unsqueeze(1), out=body)
    if width > vocab_size:
        out[:, vocab_size:] = -math.inf
    return out


def _sample_full(x: torch.Tensor, group: _Group, rows: SamplingRows, workspace: Workspace) -> torch.Tensor:
    """Rows without top_k: softmax of the whole row (min_p's dropped tokens at -inf first), a
    blocked inverse CDF, then top_p by rejection."""
    take, device = group.rows.take, x.device
    width = -(-x.shape[1] // BLOCK) * BLOCK
    scaled = _scaled(_gather(x, group.rows, "rows", workspace), take(rows.temperature), group.unit_temperature,
                     width, workspace)
    weights = workspace.take("weights", scaled.shape, torch.float32, device)
    if group.min_p is None or group.min_p.index is not None:
        torch.softmax(scaled, dim=1, out=weights)
    if group.min_p is not None:
        # logit - floor' > 0 exactly when logit >= floor (floor' is the float just below
        # floor): the others go to -inf, and the softmax of what is left is the kept set's.
        logits = _gather(scaled, group.min_p, "scratch1", workspace)
        floor = logits.amax(1, keepdim=True) + torch.log(group.min_p.take(take(rows.min_p))).unsqueeze(1)
        floor = torch.nextafter(floor, torch.full_like(floor, -math.inf))
        shifted = torch.sub(logits, floor, out=workspace.take("scratch2", logits.shape, torch.float32, device))
        shifted = F.threshold_(shifted, 0.0, -math.inf)
        if group.min_p.index is None:
            torch.softmax(shifted, dim=1, out=weights)
        else:
            weights.index_copy_(0, group.min_p.index, torch.softmax(shifted, dim=1, out=logits))
    keys, output_index = take(rows.seed_keys()), take(rows.output_index)
    # Streams 0 (the draw) to PRECOMPUTED_STREAMS - 1 (top_p's first rejection rounds) at once.
    u = _uniforms(keys, output_index, _precomputed_streams(device))
    block_sums = _block_sums(weights)
    tokens, totals = _draw_blocked(weights, u[:, 0], block_sums)
    if group.top_p is None:
        return tokens
    return _top_p_by_rejection(weights, block_sums, tokens, totals, group.top_p, take(rows.top_p), keys, output_index,
                               u, workspace)


_streams: dict[torch.device, torch.Tensor] = {}


def _precomputed_streams(device: torch.device) -> torch.Tensor:
    if device not in _streams:
        _streams[device] = torch.arange(PRECOMPUTED_STREAMS, device=device)
    return _streams[device]


def _top_p_by_rejection(weights: torch.Tensor, block_sums: torch.Tensor, tokens: torch.Tensor, totals: torch.Tensor,
                        top_p_rows: _Rows, top_p: torch.Tensor, keys: torch.Tensor, output_index: torch.Tensor,
                        precomputed: torch.Tensor, workspace: Workspace) -> torch.Tensor:
    """Draw again for the top_p rows whose token is outside their nucleus, until none is.

    A token is in iff the (fixed-point) mass strictly above its weight is below top_p x the
    row's kept total. A rejected token shows that no token at or below its weight is in, so
    the next draw (the row's next stream) is from the tokens above it only: the nucleus is
    never cut, and each round drops at least the rejected token. precomputed: [R, S] uniforms
    of streams 0 .. S - 1 of every row of weights."""
    count, width = weights.shape
    device = weights.device
    pending = top_p_rows.index if top_p_rows.index is not None else torch.arange(count, device=device)
    limit = top_p.index_select(0, pending).to(torch.float64) * totals.index_select(0, pending).to(torch.float64)
    total = totals.index_select(0, pending).to(torch.float64)
    for stream in range(1, MAX_REJECTION_ROUNDS + 1):
        chosen = weights[pending, tokens.index_select(0, pending)]
        # The mass strictly above a token is at most the total minus its own weight.
        accept = total - _fixed(chosen, PROBABILITY_BITS).to(torch.float64) < limit
        check = (~accept).nonzero().squeeze(1)
        if check.numel():
            inside = _in_nucleus(_mass_above(weights, block_sums, pending.index_select(0, check),
                                             chosen.index_select(0, check)), limit.index_select(0, check))
            accept = accept.index_copy(0, check, inside)
        rejected = (~accept).nonzero().squeeze(1)
        if not rejected.numel():
            return tokens
        bound = chosen.index_select(0, rejected).unsqueeze(1)
        pending, limit, total = (t.index_select(0, rejected) for t in (pending, limit, total))
        kept = torch.index_select(weights, 0, pending,
                                  out=workspace.take("scratch2", (pending.numel(), width), torch.float32, device))
        kept.mul_(_greater(kept, bound, workspace.take("scratch1", kept.shape, torch.float32, device)))
        if stream < precomputed.shape[1]:
            u = precomputed[:, stream].index_select(0, pending)
        else:
            u = _uniforms(keys.index_select(0, pending), output_index.index_select(0, pending), stream)
        redraw, _ = _draw_blocked(kept, u)
        tokens = tokens.index_copy(0, pending, redraw)
    raise RuntimeError("top_p rejection did not converge (NaN logits?)")


def _in_nucleus(mass_above: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Nothing above it, or less than top_p x the total: a top token is always in, even when
    top_p x the total rounds to 0 (top_p = 5e-324 is a valid request)."""
    return (mass_above < limit) | (mass_above <= 0)


def _mass_above(weights: torch.Tensor, block_sums: torch.Tensor, rows: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
    """[R, W] weights and their [R, W / BLOCK] float block sums, [N] rows of them, [N] chosen
    weights > 0 -> [N] float64: the fixed-point mass of each row's weights > its chosen one,
    summed by blocks as weight / chosen, then scaled back per block.

    Only blocks whose float sum exceeds the chosen weight can hold a weight above it (a sum is
    at least each of its terms), so only those are read: for a token in a 0.95 nucleus of a few
    hundred tokens, about a sixth of a 49152-token row, and the answer is the whole row's (the
    other blocks add exactly 0). Then two passes (a division and an in-place threshold) instead
    of a mask's four: for float32 w > c the exact quotient is >= 1 + ulp(c) / c > 1 + 2**-24,
    so it rounds above 1, and threshold (keep x > 1) keeps exactly the weights above c."""
    per_row = block_sums.shape[1]
    which, block = (block_sums.index_select(0, rows) > chosen.unsqueeze(1)).nonzero().unbind(1)
    blocks = weights.view(-1, BLOCK).index_select(0, rows.index_select(0, which) * per_row + block)
    scale = chosen.index_select(0, which)
    sums = F.threshold_(blocks.div_(scale.unsqueeze(1)), 1.0, 0.0).sum(1)
    masses = _fixed(sums * scale, PROBABILITY_BITS)
    return torch.zeros(rows.numel(), dtype=torch.long, device=weights.device).index_add_(0, which, masses).to(
        torch.float64)


def _sample_top_k(x: torch.Tensor, group: _Group, rows: SamplingRows, workspace: Workspace) -> torch.Tensor:
    """Rows with 0 < top_k < V: min_p, top_p and the draw on topk candidates."""
    take = group.rows.take
    scaled = _scaled(_gather(x, group.rows, "rows", workspace), take(rows.temperature), group.unit_temperature,
                     x.shape[1], workspace)
    params = {name: take(getattr(rows, name)) for name in ("top_k", "top_p", "min_p", "output_index")}
    params["keys"] = take(rows.seed_keys())
    return _top_k_candidates(scaled, params, min(group.max_top_k + 1, x.shape[1]), group)


def _top_k_candidates(x: torch.Tensor, params: dict[str, torch.Tensor], width: int, group: _Group) -> torch.Tensor:
    values, ids = topk(x, width)
    kth = values.gather(1, (params["top_k"] - 1).unsqueeze(1))
    # The kept set is every token >= the k-th value: all among the candidates unless that
    # value's tie run reaches the last candidate. Those rows (exact ties) look further.
    # (A k-th value of -inf, where a constraint allows fewer than k tokens, keeps every finite one:
    # all are candidates already, and the rest weigh nothing.)
    complete = (values[:, -1:] < kth).squeeze(1) | torch.isneginf(kth).squeeze(1) | (width == x.shape[1])
    if bool(complete.all()):
        return _draw_candidates(values, ids, kth, params, group)
    tokens = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for part, widen in ((complete, False), (~complete, True)):
        index = part.nonzero().squeeze(1)
        if not index.numel():
            continue
        subset = {name: value.index_select(0, index) for name, value in params.items()}
        if widen:
            chosen = _top_k_candidates(x.index_select(0, index), subset, min(4 * width, x.shape[1]), group)
        else:
            chosen = _draw_candidates(values.index_select(0, index), ids.index_select(0, index),
                                      kth.index_select(0, index), subset, group)
        tokens.index_copy_(0, index, chosen)
    return tokens


def _draw_candidates(values: torch.Tensor, ids: torch.Tensor, kth: torch.Tensor, params: dict[str, torch.Tensor],
                     group: _Group) -> torch.Tensor:
    """[R, W] candidates by descending logit, complete down to each row's k-th value."""
    top = values[:, :1]
    keep = values >= kth
    if group.min_p is not None:
        keep &= values >= top + torch.log(params["min_p"]).unsqueeze(1)
    weights = _fixed(torch.exp(values - top), WEIGHT_BITS) * keep
    if group.top_p is not None:
        # Mass strictly above each candidate's value: the exclusive cumulative sum at the first
        # candidate of its tie run (in ints: the same whatever order topk left ties in).
        before = weights.cumsum(1) - weights
        starts = torch.ones_like(keep)
        starts[:, 1:] = values[:, 1:] != values[:, :-1]
        above = torch.where(starts, before, 0).cummax(1).values
        total = weights.sum(1, keepdim=True).to(torch.float64)
        weights = weights * (above.to(torch.float64) < params["top_p"].to(torch.float64).unsqueeze(1) * total)
    return _draw_sorted_ids(ids, weights, _uniforms(params["keys"], params["output_index"], 0))


# The sampler


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    # When some row asked for logprobs (rows that did not hold NaN and -1):
    logprob: torch.Tensor | None = None  # [B] float32: log-probability of the chosen token
    top_ids: torch.Tensor | None = None  # [B, n] int64, n = the most asked in the step (<= 20)
    top_logprobs: torch.Tensor | None = None  # [B, n] float32, descending


@dataclass
class LogitAdjustments:
    """What changes some rows' logits before anything else (vLLM's order): a constraint's mask
    (tokens outside it to -inf) and OpenAI's logit_bias (added), both on the logits' device."""

    mask_rows: torch.Tensor | None = None  # [M] int64: positions of the constrained rows
    bitmask: torch.Tensor | None = None  # [M, ceil(V / 32)] int32: bit t of a row set: token t allowed
    bias_rows: torch.Tensor | None = None  # [N] int64: (position, token id, bias) triples
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None  # [N] float32


_BITS: dict[torch.device, torch.Tensor] = {}


def apply_adjustments(logits: torch.Tensor, adjust: LogitAdjustments, workspace: Workspace) -> torch.Tensor:
    """float32 logits with the adjustments applied, in a workspace buffer (logits left unchanged)."""
    count, vocab_size = logits.shape
    out = workspace.take("adjusted", (count, vocab_size), torch.float32, logits.device)
    out.copy_(logits)
    if adjust.bitmask is not None:
        device = logits.device
        if device not in _BITS:
            _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
        # Bit t of word w is token 32 w + t: unpacked for the constrained rows only.
        bits = (adjust.bitmask.unsqueeze(2) >> _BITS[device]).bitwise_and_(1)
        allowed = bits.view(bits.shape[0], -1)[:, :vocab_size]
        masked = out.index_select(0, adjust.mask_rows).masked_fill_(allowed == 0, -math.inf)
        out.index_copy_(0, adjust.mask_rows, masked)
    if adjust.bias_rows is not None:
        out.index_put_((adjust.bias_rows, adjust.bias_ids), adjust.bias_values, accumulate=True)
    return out


def sample(logits: torch.Tensor, rows: SamplingRows, history: PenaltyHistory | None = None,
           num_logprobs: int | None = None, workspace: Workspace | None = None,
           adjust: LogitAdjustments | None = None) -> SamplerOutput:
    """[B, V] logits (any float dtype; left unchanged) -> the next token of every row, and the
    logprobs the rows asked for (num_logprobs: that many top logprobs for every row instead).
    adjust: constraints' masks and logit biases, applied first (logprobs are the raw logits').
    No device sync unless a stage needs one: three per top_p rejection round (the rows to check,
    the blocks above the drawn tokens, the rows rejected), one for a top_k cut (a tie run past the
    candidates?)."""
    count, vocab_size = logits.shape
    if count != rows.batch_size:
        raise ValueError(f"{count} logit rows for {rows.batch_size} sampling rows")
    workspace = _workspace(logits.device, workspace)
    plan = rows.plan(vocab_size)
    x = apply_adjustments(logits, adjust, workspace) if adjust is not None else logits
    x = apply_penalties(x, rows, history, workspace) if plan.penalty is not None else x
    if rows.all_greedy:
        tokens = argmax(x)  # any dtype: float32 changes no argmax
    else:
        tokens = torch.empty(count, dtype=torch.long, device=logits.device)
        if plan.greedy is not None:
            tokens.index_copy_(0, plan.greedy.index, argmax(_gather(x, plan.greedy, "rows", workspace)))
        paths: tuple[tuple[_Group | None, Callable], ...] = ((plan.top_k, _sample_top_k), (plan.full, _sample_full))
        for group, path in paths:
            if group is None:
                continue
            chosen = path(x, group, rows, workspace)
            if group.rows.index is None:
                tokens = chosen
            else:
                tokens.index_copy_(0, group.rows.index, chosen)
    output = SamplerOutput(tokens)
    if num_logprobs is None:
        wanted, asking = rows.max_logprobs, plan.logprobs
    else:
        wanted = min(MAX_TOP_LOGPROBS, num_logprobs)
        asking = _Rows(None, count)
    if asking is not None and wanted >= 0:
        _add_logprobs(output, logits, asking, min(wanted, vocab_size), workspace)
    return output


def _add_logprobs(output: SamplerOutput, logits: torch.Tensor, asking: _Rows, wanted: int,
                  workspace: Workspace) -> None:
    source = _gather(logits, asking, "rows", workspace)
    # The raw logits, in the buffer the draws used (they are done with it).
    buffer = workspace.take("weights", source.shape, torch.float32, logits.device)
    logprobs = torch.log_softmax(source, dim=1, dtype=torch.float32, out=buffer)
    chosen = logprobs.gather(1, asking.take(output.token_ids).unsqueeze(1)).squeeze(1)
    if wanted:
        values, ids = topk(logprobs, wanted)
    else:  # the chosen tokens' log-probabilities only
        values = logprobs.new_empty(logprobs.shape[0], 0)
        ids = torch.empty(logprobs.shape[0], 0, dtype=torch.long, device=logprobs.device)
    if asking.index is None:
        output.logprob, output.top_logprobs, output.top_ids = chosen, values, ids
        return
    count, device = logits.shape[0], logits.device
    output.logprob = torch.full((count,), math.nan, device=device).index_copy_(0, asking.index, chosen)
    output.top_logprobs = torch.full((count, wanted), math.nan, device=device).index_copy_(0, asking.index, values)
    output.top_ids = torch.full((count, wanted), -1, dtype=torch.long, device=device).index_copy_(0, asking.index, ids)
