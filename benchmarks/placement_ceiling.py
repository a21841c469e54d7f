"""The most cache-aware placement can gain over least-loaded in hit rate, two workers: a model, not a measurement.

`benchmarks/prefix_cache.py --by-turns` measures least-loaded's hit rate and the one-worker bound
(every turn where its history is). This computes what they should be from the multiturn
workload's lengths alone, so a measured ratio can be read against a ceiling: each conversation's
turns drawn as the benchmark draws them (prefix_cache.py's multiturn_workload: a new user message
and an answer of uniform lengths), a turn finding on its worker the longest history any earlier
turn of its conversation left there (whole KV blocks of the default size, all but the token it
samples from), and the chat template's system message (one block) cached on both workers.
"Where its history is" puts every turn on one worker; "by chance" puts each turn on either worker
with probability 1/2, which is what least-loaded does when the load a turn meets does not depend on
where its conversation ran (its measured hit rates match this one's within run-to-run noise:
docs/benchmarks.md, prefix caching and placement).

    .venv/bin/python benchmarks/placement_ceiling.py [--turns 2,3,4,8]

The template's sizes are SmolLM2's (about 20 tokens of default system message, 5 per message):
only they are assumed.
"""

import argparse
import random

from prefix_cache import multiturn_workload  # (this directory; it puts the repository on the path)
from shared.config import Settings

BLOCK = Settings.model_fields["kv_block_size"].default  # tokens per KV block
SYSTEM_TOKENS = 20  # the chat template's default system message
MESSAGE_TOKENS = 5  # the template's tokens around each message
ASSISTANT_HEADER = 3  # the template's tokens that open the answer


def hit_rate(turns: int, by_chance: bool, conversations: int = 20000, seed: int = 1) -> float:
    """Prompt tokens found cached over prompt tokens, every turn of `conversations` conversations."""
    workload = multiturn_workload(turns)
    (message_low, message_high), (answer_low, answer_high) = workload.input_range, workload.output_range
    rng = random.Random(seed)
    hits = total = 0
    for _ in range(conversations):
        left_on = ([], [])  # per worker: tokens of KV each earlier turn of this conversation left there
        history = SYSTEM_TOKENS
        for _turn in range(turns):
            prompt = history + rng.randint(message_low, message_high) + MESSAGE_TOKENS + ASSISTANT_HEADER
            worker = rng.randint(0, 1) if by_chance else 0
            usable = (prompt - 1) // BLOCK  # blocks it may take from the cache: all but its last token's
            blocks = max([min(left // BLOCK, usable) for left in left_on[worker]] + [1])  # (the system block)
            hits, total = hits + blocks * BLOCK, total + prompt
            answer = rng.randint(answer_low, answer_high)
            left_on[worker].append(prompt + answer - 1)  # its sampled tokens, all but the last, were fed
            history = prompt + answer + MESSAGE_TOKENS - ASSISTANT_HEADER  # (the answer's closing tokens)
    return hits / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="2,3,4,8", help="conversation lengths (default 2,3,4,8)")
    args = parser.parse_args()
    print("| turns | hit rate, every turn where its history is | by chance | ratio (the ceiling over least-loaded) |")
    print("|---|---|---|---|")
    for turns in (int(value) for value in args.turns.split(",")):
        best, chance = hit_rate(turns, by_chance=False), hit_rate(turns, by_chance=True)
        print(f"| {turns} | {100 * best:.1f}% | {100 * chance:.1f}% | {best / chance:.2f}x |")


if __name__ == "__main__":
    main()
