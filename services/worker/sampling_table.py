"""Every held request's sampling parameters as rows of preallocated arrays (vLLM v1's persistent
input batch): written once when a plan introduces the request, gathered by row index at each
step, so a step builds no per-request object and reads no pydantic attribute.

The host copy (numpy) gives the sampler its per-step summaries without a device sync; the device
copy (one small [fields, rows] tensor per dtype) is refreshed by one copy after rows changed.
"""

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.sampler import GREEDY_BELOW, MAX_TOP_LOGPROBS, SamplingRows

if TYPE_CHECKING:
    from shared.messages import SamplingParams

# (name, default) of the float32 and the int64 parameters, as the sampler names them.
FLOAT_FIELDS = (("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("presence_penalty", 0.0),
                ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))
INT_FIELDS = (("top_k", 0), ("seed", 0), ("logprobs", -1))


class SamplingTable:
    def __init__(self, max_rows: int, device: torch.device):
        self.device = device
        self.floats = np.array([[default] * max_rows for _, default in FLOAT_FIELDS], dtype=np.float32)
        self.ints = np.array([[default] * max_rows for _, default in INT_FIELDS], dtype=np.int64)
        self._device_floats = torch.from_numpy(self.floats).to(device)
        self._device_ints = torch.from_numpy(self.ints).to(device)
        self._stale = False  # the device copy lags the host copy
        # logit_bias: each biased row's token ids and biases (few rows have any)
        self.biased = np.zeros(max_rows, dtype=bool)
        self._bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_rows

    def set(self, row: int, params: "SamplingParams") -> None:
        for index, (name, _) in enumerate(FLOAT_FIELDS):
            self.floats[index, row] = getattr(params, name)
        if params.temperature < GREEDY_BELOW:
            self.floats[0, row] = 0.0
        # logprobs: -1 none; n >= 0 the chosen token's and the n most likely tokens' (n <= 20).
        self.ints[:, row] = (params.top_k, params.seed, min(MAX_TOP_LOGPROBS, params.logprobs))
        self._stale = True
        self.biased[row] = bool(params.logit_bias)
        self._bias[row] = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self._bias[row] = (np.asarray(ids, dtype=np.int64), np.asarray(values, dtype=np.float32))

    def biases(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The logit biases of these table rows as (position among rows, token id, bias) on the
        device, or None when none of them has any."""
        positions = np.flatnonzero(self.biased[rows])
        if positions.size == 0:
            return None
        parts = [self._bias[int(rows[position])] for position in positions.tolist()]
        where = np.repeat(positions, [ids.size for ids, _ in parts])
        ids = np.concatenate([ids for ids, _ in parts])
        values = np.concatenate([values for _, values in parts])
        return tuple(torch.from_numpy(array).to(self.device, non_blocking=True) for array in (where, ids, values))

    def rows(self, rows: np.ndarray, output_indices: np.ndarray, vocab_size: int) -> SamplingRows:
        """The sampler's rows for these table rows, in this order."""
        if self._stale:
            self._device_floats.copy_(torch.from_numpy(self.floats))
            self._device_ints.copy_(torch.from_numpy(self.ints))
            self._stale = False
        index = torch.from_numpy(rows).to(self.device, non_blocking=True)
        floats = self._device_floats.index_select(1, index)
        ints = self._device_ints.index_select(1, index)
        host_floats, host_ints = self.floats[:, rows], self.ints[:, rows]
        host = {name: host_floats[i] for i, (name, _) in enumerate(FLOAT_FIELDS)}
        host |= {name: host_ints[i] for i, (name, _) in enumerate(INT_FIELDS)}
        host["output_index"] = output_indices
        temperature, top_p, min_p, presence, frequency, repetition = host_floats
        top_k, _, logprobs = host_ints
        sampling_rows = SamplingRows(
            **{name: floats[i] for i, (name, _) in enumerate(FLOAT_FIELDS)},
            **{name: ints[i] for i, (name, _) in enumerate(INT_FIELDS)},
            output_index=torch.from_numpy(output_indices).to(self.device, non_blocking=True),
            host=host,
            all_greedy=bool((temperature == 0).all()),
            any_top_k=bool((top_k > 0).any()),
            max_top_k=int(top_k.max(initial=0)),
            any_top_p=bool((top_p < 1).any()),
            any_min_p=bool((min_p > 0).any()),
            any_penalty=bool(((presence != 0) | (frequency != 0) | (repetition != 1)).any()),
            max_logprobs=int(logprobs.max(initial=-1)),
        )
        sampling_rows.plan(vocab_size)
        return sampling_rows
