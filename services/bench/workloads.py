"""What each request asks for: prompt and output lengths drawn from a workload, real text.

orca: the Orca paper's synthetic workload, input lengths uniform in [32, 512] tokens and output
      lengths uniform in [1, 128] (both ranges can be changed, e.g. to scale a run down).
chat: a long-tailed chat mix, lengths log-normal (most requests short, a few long), clipped to
      the ranges; sent to /v1/chat/completions as a user message.
multiturn: conversations (num_requests of them) of `turns` turns; each turn sends the whole
      history (its user messages and the answers it got) plus a new user message, after a think
      time (exponential, mean `think_time` s) from the previous answer; many conversations
      interleave. The input range is each new user message's, the output range each answer's.
system-prompt: many users, one long system prompt (`system_prompt_tokens`) before each user's
      own short message (the input range), as a deployed assistant sends them.

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

WorkloadName = Literal["orca", "chat", "multiturn", "system-prompt"]
WORKLOADS: tuple[WorkloadName, ...] = ("orca", "chat", "multiturn", "system-prompt")
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "benchmarks" / "corpus.txt"
LENGTHS_STREAM, PROMPTS_STREAM, THINK_STREAM = 1, 3, 5  # sub-streams of the run's seed (arrivals.py has 2)

DEFAULT_RANGES = {  # (input range, output range) in tokens
    "orca": ((32, 512), (1, 128)),
    "chat": ((8, 2048), (1, 512)),
    "multiturn": ((16, 192), (16, 128)),  # per turn: the new user message, the answer
    "system-prompt": ((8, 128), (1, 128)),  # the user's own message, the answer
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
    turns: int = 4  # multiturn: turns per conversation
    think_time: float = 1.0  # multiturn: mean seconds between an answer and the next turn
    system_prompt_tokens: int = 512  # system-prompt: its length

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}: choose from {', '.join(WORKLOADS)}")
        for label, (low, high) in (("input", self.inputs), ("output", self.outputs)):
            if not 1 <= low <= high:
                raise ValueError(f"{label} range must be 1 <= low <= high (got {low}, {high})")
        if self.turns < 1 or self.think_time < 0 or self.system_prompt_tokens < 1:
            raise ValueError("turns and system_prompt_tokens must be >= 1, think_time >= 0")

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
        if self.name == "multiturn":
            return (f"multiturn: {self.turns} turns per conversation, each a new user message of {in_low}-{in_high} "
                    f"tokens after {self.think_time:g} s mean think time, answers of {out_low}-{out_high} tokens")
        if self.name == "system-prompt":
            return (f"system-prompt: one {self.system_prompt_tokens}-token system prompt, then each user's message "
                    f"of {in_low}-{in_high} tokens, answers of {out_low}-{out_high} tokens")
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
    conversation: int = -1  # multiturn: which conversation, and which of its turns
    turn: int = 0
    prompt_text: str = ""  # completions: text instead of token ids (`bench serve`'s ShareGPT prompts)
    ignore_eos: bool = True  # forced lengths (`bench serve` forces them only when asked, as vLLM's)

    def body(self, model: str, temperature: float | None) -> dict:
        """The request's JSON; temperature None leaves it to the server's default (vLLM's bench does)."""
        body = {"model": model, "max_tokens": self.max_tokens, "seed": self.seed, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if temperature is not None:
            body["temperature"] = temperature
        if self.endpoint == "chat":
            body["messages"] = list(self.messages)
        else:
            body["prompt"] = self.prompt_text or list(self.prompt)
        return body


def draw_lengths(config: WorkloadConfig, count: int, seed: int) -> tuple[list[int], list[int]]:
    """Input and output lengths of `count` requests; the same for the same seed, whatever the rate."""
    rng = np.random.default_rng([seed, LENGTHS_STREAM])
    (in_low, in_high), (out_low, out_high) = config.inputs, config.outputs
    if config.name != "chat":
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


@dataclass(frozen=True)
class Conversation:
    """A multiturn conversation: its user messages, each answer's length, the pause before each turn."""

    index: int
    user_messages: tuple[str, ...]
    user_tokens: tuple[int, ...]
    max_tokens: tuple[int, ...]
    think_seconds: tuple[float, ...]  # before each turn after the first
    seed: int

    def request(self, turn: int, history: tuple[dict, ...], chat_overhead: int, turns: int) -> BenchRequest:
        """Turn `turn`'s request: the history so far (user messages and answers) and its new message."""
        messages = history + ({"role": "user", "content": self.user_messages[turn]},)
        prompt_tokens = sum(self.user_tokens[: turn + 1]) + chat_overhead * (2 * turn + 1)  # answers: from usage
        return BenchRequest(self.index * turns + turn, "chat", prompt_tokens, self.max_tokens[turn], self.seed + turn,
                            messages=messages, conversation=self.index, turn=turn)


def build_conversations(config: WorkloadConfig, count: int, seed: int, source: PromptSource) -> list[Conversation]:
    turns = config.turns
    inputs, outputs = draw_lengths(config, count * turns, seed)
    rng = np.random.default_rng([seed, PROMPTS_STREAM])
    offsets = rng.integers(0, len(source.corpus_ids), size=count * turns)
    seeds = rng.integers(0, 2**62, size=count)
    think = np.random.default_rng([seed, THINK_STREAM]).exponential(config.think_time, size=count * turns)
    conversations = []
    for index in range(count):
        span = range(index * turns, (index + 1) * turns)
        conversations.append(Conversation(
            index, tuple(source.text_of_length(int(offsets[position]), inputs[position]) for position in span),
            tuple(inputs[position] for position in span), tuple(outputs[position] for position in span),
            tuple(float(think[position]) for position in span[1:]), int(seeds[index])))
    return conversations


def build_requests(config: WorkloadConfig, count: int, seed: int, source: PromptSource) -> list[BenchRequest]:
    """The requests of a workload whose requests do not depend on answers (all but multiturn)."""
    if config.name == "multiturn":
        raise ValueError("multiturn requests depend on the answers: build_conversations")
    inputs, outputs = draw_lengths(config, count, seed)
    rng = np.random.default_rng([seed, PROMPTS_STREAM])
    offsets = rng.integers(0, len(source.corpus_ids), size=count)
    seeds = rng.integers(0, 2**62, size=count)
    requests = []
    system = ({"role": "system", "content": source.text_of_length(0, config.system_prompt_tokens)}
              if config.name == "system-prompt" else None)  # the same for everyone: a fixed window of the corpus
    for index, (input_tokens, output_tokens) in enumerate(zip(inputs, outputs, strict=True)):
        offset, request_seed = int(offsets[index]), int(seeds[index])
        if system is not None:
            message = {"role": "user", "content": source.text_of_length(offset, input_tokens)}
            requests.append(BenchRequest(index, "chat", source.chat_overhead * 2 + config.system_prompt_tokens
                                         + input_tokens, output_tokens, request_seed, messages=(system, message)))
        elif config.name == "chat":
            content_tokens = max(1, input_tokens - source.chat_overhead)
            message = {"role": "user", "content": source.text_of_length(offset, content_tokens)}
            requests.append(BenchRequest(index, "chat", source.chat_overhead + content_tokens, output_tokens, request_seed,
                                         messages=(message,)))
        else:
            requests.append(BenchRequest(index, "completions", input_tokens, output_tokens, request_seed,
                                         prompt=tuple(source.window(offset, input_tokens))))
    return requests
