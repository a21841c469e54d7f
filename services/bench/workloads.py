"""What each request asks for: prompt and output lengths drawn from a workload, real text.

orca: the Orca paper's synthetic workload, input lengths uniform in [32, 512] tokens and output
      lengths uniform in [1, 128] (both ranges can be changed, e.g. to scale a run down).
chat: a long-tailed chat mix, lengths log-normal (most requests short, a few long), clipped to
      the ranges; sent to /v1/chat/completions as a user message.

Output lengths are forced: max_tokens plus `ignore_eos`, so a run's work does not depend on
what the model happens to say. Prompts are windows of benchmarks/corpus.txt (real prose) in
the model's own tokens: sent as token-id lists to /v1/completions (exact length), or for chat
as text that encodes back to the wanted number of tokens.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from shared.tokenizer import Tokenizer

WorkloadName = Literal["orca", "chat"]
WORKLOADS: tuple[WorkloadName, ...] = ("orca", "chat")
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "benchmarks" / "corpus.txt"
LENGTHS_STREAM, PROMPTS_STREAM = 1, 3  # sub-streams of the run's seed (arrivals.py has 2)

DEFAULT_RANGES = {  # (input range, output range) in tokens
    "orca": ((32, 512), (1, 128)),
    "chat": ((8, 2048), (1, 512)),
}
CHAT_INPUT_MEDIAN, CHAT_INPUT_SIGMA = 128, 1.0
CHAT_OUTPUT_MEDIAN, CHAT_OUTPUT_SIGMA = 64, 0.9


@dataclass(frozen=True)
class WorkloadConfig:
    name: WorkloadName = "orca"
    input_range: tuple[int, int] | None = None  # None: the workload's default
    output_range: tuple[int, int] | None = None
    input_median: int = CHAT_INPUT_MEDIAN  # chat only
    output_median: int = CHAT_OUTPUT_MEDIAN  # chat only
    temperature: float = 0.0  # greedy; each request also carries its own seed

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}: choose from {', '.join(WORKLOADS)}")
        for label, (low, high) in (("input", self.inputs), ("output", self.outputs)):
            if not 1 <= low <= high:
                raise ValueError(f"{label} range must be 1 <= low <= high (got {low}, {high})")

    @property
    def inputs(self) -> tuple[int, int]:
        return tuple(self.input_range or DEFAULT_RANGES[self.name][0])

    @property
    def outputs(self) -> tuple[int, int]:
        return tuple(self.output_range or DEFAULT_RANGES[self.name][1])

    def describe(self) -> str:
        (in_low, in_high), (out_low, out_high) = self.inputs, self.outputs
        if self.name == "orca":
            return f"orca: input uniform {in_low}-{in_high} tokens, output uniform {out_low}-{out_high} tokens"
        return (f"chat: input log-normal median {self.input_median} clipped {in_low}-{in_high}, "
                f"output log-normal median {self.output_median} clipped {out_low}-{out_high} tokens")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    endpoint: Literal["completions", "chat"]
    prompt_tokens: int  # as drawn (chat: the whole templated prompt, approximately)
    max_tokens: int
    seed: int
    prompt: tuple[int, ...] = ()  # completions: token ids
    messages: tuple[dict, ...] = field(default=())  # chat

    def body(self, model: str, temperature: float) -> dict:
        body = {"model": model, "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": temperature,
                "seed": self.seed, "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = list(self.messages)
        else:
            body["prompt"] = list(self.prompt)
        return body


def draw_lengths(config: WorkloadConfig, count: int, seed: int) -> tuple[list[int], list[int]]:
    """Input and output lengths of `count` requests; the same for the same seed, whatever the rate."""
    rng = np.random.default_rng([seed, LENGTHS_STREAM])
    (in_low, in_high), (out_low, out_high) = config.inputs, config.outputs
    if config.name == "orca":
        inputs = rng.integers(in_low, in_high, size=count, endpoint=True)
        outputs = rng.integers(out_low, out_high, size=count, endpoint=True)
    else:
        inputs = np.rint(rng.lognormal(math.log(config.input_median), CHAT_INPUT_SIGMA, size=count))
        outputs = np.rint(rng.lognormal(math.log(config.output_median), CHAT_OUTPUT_SIGMA, size=count))
        inputs, outputs = np.clip(inputs, in_low, in_high), np.clip(outputs, out_low, out_high)
    return [int(n) for n in inputs], [int(n) for n in outputs]


class PromptSource:
    """Windows of a real text, in the model's tokens, at seeded offsets."""

    def __init__(self, tokenizer: Tokenizer, corpus: Path = DEFAULT_CORPUS) -> None:
        if not corpus.is_file():
            raise FileNotFoundError(f"no prompt corpus at {corpus} (pass --corpus with a text file)")
        self.tokenizer = tokenizer
        self.corpus_ids = tokenizer.encode(corpus.read_text())
        if len(self.corpus_ids) < 16:
            raise ValueError(f"corpus {corpus} is too short: {len(self.corpus_ids)} tokens")
        self.chat_overhead = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))

    def window(self, offset: int, length: int) -> list[int]:
        """`length` corpus tokens from `offset`, wrapping around (the corpus repeats for long prompts)."""
        size = len(self.corpus_ids)
        return [self.corpus_ids[(offset + position) % size] for position in range(length)]

    def text_of_length(self, offset: int, length: int) -> str:
        """Text that encodes to `length` tokens (or within a token or two of it, rarely)."""
        ids = self.window(offset, length)
        text = self.tokenizer.decode(ids)
        for attempt in range(8):
            encoded = self.tokenizer.encode(text)
            if len(encoded) == length:
                return text
            if len(encoded) > length:
                ids = encoded[:length]
            else:  # merges at the cut made it shorter: take a little more text
                ids = encoded + self.window(offset + length + attempt, length - len(encoded))
            text = self.tokenizer.decode(ids)
        return text


def build_requests(config: WorkloadConfig, count: int, seed: int, source: PromptSource) -> list[BenchRequest]:
    inputs, outputs = draw_lengths(config, count, seed)
    rng = np.random.default_rng([seed, PROMPTS_STREAM])
    offsets = rng.integers(0, len(source.corpus_ids), size=count)
    seeds = rng.integers(0, 2**62, size=count)
    requests = []
    for index, (input_tokens, output_tokens) in enumerate(zip(inputs, outputs, strict=True)):
        offset, request_seed = int(offsets[index]), int(seeds[index])
        if config.name == "chat":
            content_tokens = max(1, input_tokens - source.chat_overhead)
            message = {"role": "user", "content": source.text_of_length(offset, content_tokens)}
            requests.append(BenchRequest(index, "chat", source.chat_overhead + content_tokens, output_tokens, request_seed,
                                         messages=(message,)))
        else:
            requests.append(BenchRequest(index, "completions", input_tokens, output_tokens, request_seed,
                                         prompt=tuple(source.window(offset, input_tokens))))
    return requests
