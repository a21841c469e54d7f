"""From per-request timings to a report: throughput, latency distributions, goodput.

Definitions (those of vLLM's benchmark_serving and of the Orca paper):
- duration: first request sent to last request ended; throughputs divide by it.
- TTFT: time to the first content chunk. TPOT: (end - first token) / (output tokens - 1), per
  request. ITL: every gap between consecutive chunks, pooled over requests.
- normalized latency (Orca): end-to-end latency / output tokens, per request.
- goodput: completed requests per second that met every given target (TTFT, TPOT).
Latencies are over the requests that completed normally (not cancelled, not failed).
"""

import math
from collections.abc import Iterable, Sequence

from services.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99, max of values times scale (e.g. 1000 for ms)."""
    scaled = [value * scale for value in values]
    if not scaled:
        return {"mean": math.nan, **{f"p{q}": math.nan for q in PERCENTILES}, "max": math.nan}
    return {"mean": sum(scaled) / len(scaled), **{f"p{q}": percentile(scaled, q) for q in PERCENTILES},
            "max": max(scaled)}


def summarize(results: Sequence[RequestResult], ttft_slo: float | None = None,
              tpot_slo: float | None = None) -> dict:
    """The report's numbers. SLOs in seconds; latencies reported in ms (e2e in s)."""
    ok = [result for result in results if result.ok]
    cancelled = [result for result in results if result.cancelled]
    failed = [result for result in results if not result.ok and not result.cancelled]
    started = min((result.sent_at for result in results), default=0.0)
    ended = max((result.finished_at or result.sent_at for result in results), default=0.0)
    duration = max(ended - started, 1e-9)
    output_tokens = sum(result.output_tokens for result in ok)
    prompt_tokens = sum(result.prompt_tokens for result in ok)
    good = [result for result in ok if meets(result, ttft_slo, tpot_slo)]
    return {
        "requests": len(results),
        "completed": len(ok),
        "cancelled": len(cancelled),
        "failed": len(failed),
        "errors": sorted({result.error for result in failed if result.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        # Tokens streamed to all clients, cancelled requests' partial output included.
        "delivered_token_throughput": sum(result.output_tokens for result in results if result.error is None) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "ttft_ms": distribution((result.ttft for result in ok if result.ttft is not None), 1000),
        "tpot_ms": distribution((result.tpot for result in ok if result.tpot is not None), 1000),
        "itl_ms": distribution((gap for result in ok for gap in result.itls), 1000),
        "e2e_s": distribution(result.e2e for result in ok if result.e2e is not None),
        "normalized_latency_ms_per_token": distribution(
            (normalized_latency(result) for result in ok if result.output_tokens > 0), 1000),
        # Prefix caching, from each answer's usage.prompt_tokens_details.cached_tokens.
        "prefix_cache": {"prompt_tokens": prompt_tokens, "cached_tokens": sum(result.cached_tokens for result in ok),
                         "hit_rate": sum(result.cached_tokens for result in ok) / prompt_tokens if prompt_tokens else None},
        # Multiturn: the turns that have a history (the cache can serve it), apart.
        "ttft_ms_later_turns": distribution((result.ttft for result in ok if result.turn > 0 and result.ttft is not None),
                                            1000),
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
        "goodput": len(good) / duration if ttft_slo is not None or tpot_slo is not None else None,
        "slo_attainment": len(good) / len(ok) if ok and (ttft_slo is not None or tpot_slo is not None) else None,
    }


def normalized_latency(result: RequestResult) -> float:
    return result.e2e / result.output_tokens


def meets(result: RequestResult, ttft_slo: float | None, tpot_slo: float | None) -> bool:
    if ttft_slo is not None and (result.ttft is None or result.ttft > ttft_slo):
        return False
    if tpot_slo is not None and result.tpot is not None and result.tpot > tpot_slo:
        return False  # a one-token request has no TPOT: it meets the target
    return True


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown(summary: dict, title: str = "Benchmark") -> str:
    """The report as a markdown table, for people."""
    lines = [
        f"### {title}", "",
        f"{summary['completed']} completed, {summary['cancelled']} cancelled, {summary['failed']} failed "
        f"of {summary['requests']} requests in {summary['duration_s']:.1f} s", "",
        "| throughput | |", "|---|---|",
        f"| requests/s | {_fmt(summary['request_throughput'], 3)} |",
        f"| output tokens/s | {_fmt(summary['output_token_throughput'])} |",
        f"| total tokens/s (prompt + output) | {_fmt(summary['total_token_throughput'])} |",
    ]
    if summary.get("goodput") is not None:
        slo = summary["slo"]
        targets = ", ".join(f"{name} <= {value * 1000:.0f} ms" for name, value in
                            (("TTFT", slo["ttft_s"]), ("TPOT", slo["tpot_s"])) if value is not None)
        lines.append(f"| goodput requests/s ({targets}) | {_fmt(summary['goodput'], 3)} "
                     f"({_fmt(100 * summary['slo_attainment'], 0)}% met) |")
    cache = summary.get("prefix_cache") or {}
    if cache.get("hit_rate"):
        lines.append(f"| prefix cache hit rate (prompt tokens found cached) | {_fmt(100 * cache['hit_rate'])}% |")
    later_turns = summary.get("ttft_ms_later_turns") or {}
    lines += ["", "| latency | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    rows = (("ttft_ms", "time to first token (ms)"),
            *((("ttft_ms_later_turns", "time to first token, turns 2+ (ms)"),)
              if not math.isnan(later_turns.get("mean", math.nan)) else ()),
            ("tpot_ms", "time per output token (ms)"),
            ("itl_ms", "inter-token latency (ms)"), ("e2e_s", "end-to-end latency (s)"),
            ("normalized_latency_ms_per_token", "normalized latency (ms/token)"))
    for key, label in rows:
        row = summary[key]
        digits = 2 if key == "e2e_s" else 1
        lines.append(f"| {label} | " + " | ".join(_fmt(row[stat], digits) for stat in ("mean", "p50", "p90", "p99")) + " |")
    if summary["errors"]:
        lines += ["", "Errors: " + "; ".join(summary["errors"])]
    return "\n".join(lines) + "\n"
