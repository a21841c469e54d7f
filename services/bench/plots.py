"""PNG figures of the experiments (matplotlib, headless). Optional: without matplotlib the
experiments still write their JSON and markdown, and say how to get the plots."""

import math
from pathlib import Path


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


COLORS = {"iteration": "#1f77b4", "request": "#d62728", "request-stream": "#ff7f0e"}
LABELS = {"iteration": "iteration-level (Orca)", "request": "request-level (Orca's baseline: results at batch end)",
          "request-stream": "request-level, streaming each token"}


def latency_vs_throughput(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    """The Orca paper's figure: median normalized latency against throughput, one line per policy."""
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    latencies = []
    for policy, points in curves.items():
        points = sorted(points, key=lambda point: point["rate"])
        x = [point["request_throughput"] for point in points]
        y = [point["normalized_latency_p50_ms"] for point in points]
        latencies += [value for value in y if value > 0 and math.isfinite(value)]
        axes.plot(x, y, marker="o", color=COLORS.get(policy), label=LABELS.get(policy, policy))
        for point, x_value, y_value in zip(points, x, y):
            axes.annotate(f"{point['rate']:.2g}/s", (x_value, y_value), textcoords="offset points", xytext=(4, 4),
                          fontsize=7, color=COLORS.get(policy))
    if latencies and max(latencies) / min(latencies) > 20:
        axes.set_yscale("log")
    axes.set_xlabel("throughput (requests/s)")
    axes.set_ylabel("median normalized latency (ms/token)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot.close(figure)


def bars(groups: list[str], series: dict[str, list[float]], path: Path, title: str, ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per series."""
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(7, 4))
    width = 0.8 / max(len(series), 1)
    for position, (name, values) in enumerate(series.items()):
        offsets = [index + (position - (len(series) - 1) / 2) * width for index in range(len(groups))]
        drawn = axes.bar(offsets, values, width, label=name)
        axes.bar_label(drawn, fmt="%.3g", fontsize=7)
    axes.set_xticks(range(len(groups)), groups)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.grid(True, axis="y", alpha=0.3)
    if len(series) > 1:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot.close(figure)


def stacked_bar(parts: dict[str, float], path: Path, title: str, xlabel: str) -> None:
    """One horizontal bar split into named parts (where the time goes)."""
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(8, 1.8))
    left = 0.0
    for name, value in parts.items():
        axes.barh([0], [value], left=left, label=f"{name} ({value:.1f})")
        left += value
    axes.set_yticks([])
    axes.set_xlabel(xlabel)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot.close(figure)
