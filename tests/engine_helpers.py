"""Drive an Engine the way the scheduler does: prefill, then one decode step per token."""

from services.worker.engine import Engine
from shared.messages import SamplingParams, StepItem

GREEDY = SamplingParams(max_tokens=64)


def prefill_item(request_id: str, token_ids, start: int = 0, output_index: int = 0, sample: bool = True) -> StepItem:
    return StepItem(request_id=request_id, token_ids=tuple(token_ids), start_position=start, sample=sample,
                    output_index=output_index)


def decode_item(request_id: str, token_id: int, position: int, output_index: int) -> StepItem:
    return StepItem(request_id=request_id, token_ids=(token_id,), start_position=position, sample=True,
                    output_index=output_index)


def generate_alone(engine: Engine, request_id: str, prompt: list[int], count: int,
                   sampling: SamplingParams = GREEDY, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """The request run with nothing else in its batch."""
    engine.add_request(request_id, sampling)
    output = [engine.step([prefill_item(request_id, prompt)]).tokens[request_id]]
    while len(output) < count and output[-1] not in stop_ids:
        item = decode_item(request_id, output[-1], len(prompt) + len(output) - 1, len(output))
        output.append(engine.step([item]).tokens[request_id])
    engine.free(request_id)
    return output
