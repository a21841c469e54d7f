"""Sampling benchmark: the batched sampler (services/worker/sampler.py) beside the per-row
sampler it replaced (per-row on the host, kept in benchmarks/per_row_sampler.py), same logits, same run.

    .venv/bin/python benchmarks/sampling.py [--threads 2] [--batch-sizes 1 16 64] [--real]

Logits: a stand-in shaped like a language model's (Zipf-like ranks: log-probability falling
as -alpha * log(rank), alpha drawn per row, plus noise), or with --real the last-token logits
of SmolLM2 on corpus prompts (loads the model, about a minute). It prints the 0.95-nucleus
sizes of both kinds of rows it uses, then a markdown table of milliseconds per call (the
median over calls) per configuration and batch size. The old sampler ignores what it lacks
(min_p, penalties, logprobs): its column then times its own work on the same rows.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from services.worker.sampler import PenaltyHistory, SamplingRows, sample  # noqa: E402
from per_row_sampler import sample_tokens  # noqa: E402  (the sampler this replaced, kept to compare)

VOCAB = 49152
CONFIGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 1 + top_p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "temperature 0.8 + top_k 50": {"temperature": 0.8, "top_k": 50},
    "temperature 0.8 + min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "temperature 0.8 + penalties": {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                                    "repetition_penalty": 1.1},
    "temperature 0.8 + logprobs 5": {"temperature": 0.8, "logprobs": 5},
}
OLD_IGNORES = {"temperature 0.8 + min_p 0.05": "min_p", "temperature 0.8 + penalties": "penalties",
               "temperature 0.8 + logprobs 5": "logprobs"}


def stand_in_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Log-probabilities -alpha * log(rank) over a random ranking of the vocabulary, alpha in
    [1.25, 1.8) per row, plus N(0, 1) noise: 0.95-nuclei from a few tokens to thousands, in the
    range of SmolLM2's at temperature 1 (median ~260, 90th percentile ~1600)."""
    generator = torch.Generator().manual_seed(seed)
    alpha = torch.rand(rows, 1, generator=generator) * 0.55 + 1.25
    ranks = torch.rand(rows, vocab, generator=generator).argsort(1).to(torch.float32) + 1
    return -alpha * ranks.log() + torch.randn(rows, vocab, generator=generator) + 8.0


def real_logits(rows: int) -> torch.Tensor:
    """SmolLM2's next-token logits after `rows` corpus prompts of different lengths."""
    from benchmarks.engine import item, prompt_ids
    from services.bench.logits import LogitsEngine as Engine  # (its steps hand back the logits)
    from shared.config import Settings
    from shared.messages import SamplingParams
    from shared.tokenizer import Tokenizer

    engine = Engine.from_settings(Settings(kv_blocks=rows * 160 // 16 + 8, device="cpu", dtype="float32"))
    prompts = [prompt[: 16 + (37 * i) % 112] for i, prompt in enumerate(prompt_ids(Tokenizer.load(), rows))]
    logits = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), SamplingParams())
        logits.append(engine.step([item(str(i), prompt, 0)], return_logits=True).logits[str(i)])
    return torch.stack(logits)


def nucleus_sizes(logits: torch.Tensor, top_p: float = 0.95) -> list[int]:
    probabilities = torch.softmax(logits.float(), dim=1).sort(dim=1, descending=True).values
    return (probabilities.cumsum(1) - probabilities < top_p).sum(1).tolist()


def quantiles(values: list[int]) -> str:
    ordered = sorted(values)
    picks = [("min", 0.0), ("p10", 0.1), ("p25", 0.25), ("median", 0.5), ("p75", 0.75), ("p90", 0.9), ("max", 1.0)]
    return ", ".join(f"{name} {ordered[min(len(ordered) - 1, int(q * len(ordered)))]}" for name, q in picks)


def milliseconds(call, calls: int) -> float:
    call()
    call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--calls", type=int, default=40, help="timed calls of the new sampler (median kept)")
    parser.add_argument("--old-calls", type=int, default=5, help="timed calls of the old one")
    parser.add_argument("--real", action="store_true", help="SmolLM2's logits instead of the stand-in")
    args = parser.parse_args()
    rows = max(args.batch_sizes)
    logits = real_logits(rows) if args.real else stand_in_logits(rows, VOCAB)
    print("# The batched sampler against the per-row one it replaced (executor: none, the sampler alone on "
          f"{'SmolLM2-135M logits' if args.real else 'stand-in logits'})\n")
    print(f"logits: {'SmolLM2-135M, last prompt token' if args.real else 'stand-in'} [{rows}, {logits.shape[1]}]; "
          f"0.95-nucleus sizes at temperature 1: {quantiles(nucleus_sizes(logits))}; "
          f"at 0.8: {quantiles(nucleus_sizes(logits / 0.8))}")
    # Penalties: 200 prompt tokens and 50 output tokens per row, ids spread over the vocabulary.
    prompts = [[(row * 7919 + i * 104729) % VOCAB for i in range(200)] for row in range(rows)]
    outputs = [[(row * 31 + i * 7) % VOCAB for i in range(50)] for row in range(rows)]
    history = PenaltyHistory.from_lists(prompts, outputs)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s), load average {os.getloadavg()[0]:.2f}; ms per call (median)\n")
        print("| configuration | rows | batched | per-row (old) | speed-up |")
        print("|---|---:|---:|---:|---:|")
        for name, fields in CONFIGS.items():
            for batch in args.batch_sizes:
                params = [SimpleNamespace(**{"top_k": 0, "top_p": 1.0, "seed": 1000 + row, **fields})
                          for row in range(batch)]
                part = logits[:batch].contiguous()
                sampling_rows = SamplingRows.from_params(params, list(range(batch)), vocab_size=part.shape[1])
                part_history = PenaltyHistory(history.prompt_ids[:batch], history.output_ids[:batch])
                new = milliseconds(lambda: sample(part, sampling_rows, part_history), args.calls)
                old = milliseconds(lambda: sample_tokens(part, params, list(range(batch))), args.old_calls)
                note = f" (ignores {OLD_IGNORES[name]})" if name in OLD_IGNORES else ""
                print(f"| {name} | {batch} | {new:.3f} | {old:.2f}{note} | {old / new:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
