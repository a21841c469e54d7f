"""An engine whose steps can also hand back the logits each sampled row was sampled from: for the
oracles that compare them (transformers against the engine, batch invariance, the GPU check), kept
out of the serving engine's hot path (services/worker/engine.py samples and keeps none)."""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.engine import Engine
from services.worker.rows import StepOutcome
from services.worker.sampler import SamplerOutput

if TYPE_CHECKING:  # (torch and numpy only at run time, as the engine: benchmarks/gpu_check.py runs where little else is)
    from shared.messages import StepItem


class LogitsEngine(Engine):
    """Engine.step(items, return_logits=True) gives the outcome a `logits` dict: each sampled
    request's [V] float32 logits, on the host (before penalties, temperature and truncation)."""

    _captured: list[torch.Tensor] | None = None

    def step(self, items: Sequence["StepItem"], return_logits: bool = False) -> StepOutcome:
        self._captured = [] if return_logits else None
        try:
            outcome = super().step(items)
        finally:
            captured, self._captured = self._captured, None
        if return_logits:
            logits = captured[0] if captured else None
            # (outcome.tokens lists the sampled requests in the order of their logit rows)
            outcome.logits = {request_id: logits[index].float().cpu()  # type: ignore[attr-defined]
                              for index, request_id in enumerate(outcome.tokens)} if logits is not None else {}
        return outcome

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, output_indices: np.ndarray) -> SamplerOutput:
        if self._captured is not None:
            self._captured.append(logits)
        return super()._sample(logits, rows, output_indices)
