"""Which grammar engine constrains structured outputs: llguidance against xgrammar, measured on the
served model's vocabulary (SmolLM2's 49,152 tokens by default).

  python -m benchmarks.grammar_engines [--model GGUF] [--batch 64] [--steps 40]

1. Compile time of each of the 20 schemas of benchmarks/schemas.py (a fresh compiler each time,
   no cache: what the first request with a new schema pays).
2. Mask time per step at batch 64: 64 matchers (the 20 schemas, round robin), each fed a valid
   instance's tokens one at a time; a step fills the 64 rows' bitmasks ([64, V/32] int32), applies
   them to [64, V] float32 logits and feeds each matcher its next token. Reported per step, split
   into fill, apply and consume.

xgrammar is optional here (`pip install --no-deps xgrammar apache-tvm-ffi`): it needs transformers and
triton as dependencies of a serving install, llguidance nothing.
"""

import argparse
import json
import statistics
import time

import torch

from benchmarks.schemas import SCHEMAS
from shared.tokenizer import Tokenizer


def instance_tokens(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(json.dumps(instance)) for _, _, instance in SCHEMAS]


def run_llguidance(tokenizer: Tokenizer, batch: int, steps: int) -> dict:
    import llguidance
    import llguidance.torch as llt

    started = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=tokenizer.vocab_size,
                                          eos_token=sorted(tokenizer.stop_token_ids))
    tokenizer_seconds = time.perf_counter() - started
    compile_ms = []
    grammars = []
    for _, schema, _ in SCHEMAS:
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        compile_ms.append((time.perf_counter() - started) * 1000)
        assert not matcher.is_error(), matcher.get_error()
        grammars.append(grammar)
    matchers = [llguidance.LLMatcher(ll_tokenizer, grammars[i % len(SCHEMAS)]) for i in range(batch)]
    bitmask = llt.allocate_token_bitmask(batch, tokenizer.vocab_size)

    def fill(row: int, matcher) -> None:
        llt.fill_next_token_bitmask(matcher, bitmask, row)

    def consume(matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    return {"tokenizer_s": tokenizer_seconds, "compile_ms": compile_ms,
            **_steps(matchers, fill, consume, bitmask, tokenizer, batch, steps,
                     lambda logits: llt.apply_token_bitmask_inplace(logits, bitmask))}


def run_xgrammar(tokenizer: Tokenizer, batch: int, steps: int) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo([tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)], xgr.VocabType.RAW,
                             vocab_size=tokenizer.vocab_size, stop_token_ids=sorted(tokenizer.stop_token_ids))
    tokenizer_seconds = time.perf_counter() - started
    compile_ms, compiled = [], []
    for _, schema, _ in SCHEMAS:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        started = time.perf_counter()
        compiled.append(compiler.compile_json_schema(json.dumps(schema)))
        compile_ms.append((time.perf_counter() - started) * 1000)
    matchers = [xgr.GrammarMatcher(compiled[i % len(SCHEMAS)]) for i in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, tokenizer.vocab_size)

    def fill(row: int, matcher) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(matcher, token: int) -> None:
        assert matcher.accept_token(token)

    return {"tokenizer_s": tokenizer_seconds, "compile_ms": compile_ms,
            **_steps(matchers, fill, consume, bitmask, tokenizer, batch, steps,
                     lambda logits: xgr.apply_token_bitmask_inplace(logits, bitmask))}


def _steps(matchers, fill, consume, bitmask, tokenizer: Tokenizer, batch: int, steps: int, apply) -> dict:
    tokens = instance_tokens(tokenizer)
    streams = [tokens[i % len(SCHEMAS)] for i in range(batch)]
    logits = torch.randn(batch, tokenizer.vocab_size)
    fills, applies, consumes = [], [], []
    for step in range(steps):
        live = [(row, matcher) for row, matcher in enumerate(matchers) if step < len(streams[row])]
        if not live:
            break
        started = time.perf_counter()
        for row, matcher in live:
            fill(row, matcher)
        filled = time.perf_counter()
        apply(logits)
        applied = time.perf_counter()
        for row, matcher in live:
            consume(matcher, streams[row][step])
        consumed = time.perf_counter()
        fills.append((filled - started) * 1000)
        applies.append((applied - filled) * 1000)
        consumes.append((consumed - applied) * 1000)
    return {"fill_ms": statistics.median(fills), "apply_ms": statistics.median(applies),
            "consume_ms": statistics.median(consumes), "steps": len(fills)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.load(args.model) if args.model else Tokenizer.load()
    results = {"llguidance": run_llguidance(tokenizer, args.batch, args.steps)}
    try:
        results["xgrammar"] = run_xgrammar(tokenizer, args.batch, args.steps)
    except ImportError as error:
        print(f"xgrammar not installed ({error}): llguidance alone")
    print(f"vocabulary {tokenizer.vocab_size}, batch {args.batch}, one thread")
    print("| engine | tokenizer set-up s | compile ms: median | max | sum of 20 | mask step ms at batch "
          f"{args.batch}: fill | apply | consume |")
    print("|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        compile_ms = result["compile_ms"]
        print(f"| {name} | {result['tokenizer_s']:.2f} | {statistics.median(compile_ms):.1f} | {max(compile_ms):.1f} "
              f"| {sum(compile_ms):.0f} | {result['fill_ms']:.2f} | {result['apply_ms']:.2f} "
              f"| {result['consume_ms']:.2f} |")
    for name, result in results.items():
        print(name, "compile ms per schema:", ", ".join(f"{label} {ms:.1f}" for (label, _, _), ms
                                                         in zip(SCHEMAS, result["compile_ms"])))


if __name__ == "__main__":
    main()
