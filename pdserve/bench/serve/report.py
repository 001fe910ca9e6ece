"""What `pdserve bench` prints and writes: the result block, the JSON file (vLLM's key names) and PNG plots.

Plots use matplotlib's Agg backend (no display needed); matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.serve.client import LoadResult
from pdserve.bench.serve.metrics import LATENCY_METRICS, PERCENTILES, Summary, itls_s, tpot_s

_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def format_summary(summary: Summary, title: str = "Serving Benchmark Result") -> str:
    """vLLM-style result block (same labels, so the two tools' outputs read alike)."""
    rows: list[tuple[str, str]] = [
        ("Successful requests:", str(summary.completed)),
        ("Failed requests:", str(summary.failed)),
        *[(f"  failed, {kind}:", str(n)) for kind, n in summary.failures.items()],
        ("Cancelled by the client:", str(summary.cancelled)),
        ("Maximum concurrent requests:", str(summary.max_concurrent_requests)),
        ("Benchmark duration (s):", f"{summary.duration_s:.2f}"),
        ("Total input tokens:", str(summary.total_input_tokens)),
        ("Total generated tokens:", str(summary.total_output_tokens)),
        ("Request throughput (req/s):", f"{summary.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{summary.output_throughput:.2f}"),
        ("Total Token throughput (tok/s):", f"{summary.total_token_throughput:.2f}"),
    ]
    if summary.request_goodput is not None:
        rows.append(("Request goodput (req/s):", f"{summary.request_goodput:.2f}"))
        rows.append(("  SLO:", str(summary.slo)))
    lines = [f"{' ' + title + ' ':=^60}"] + [f"{k:<44}{v:<16}" for k, v in rows]
    for name in LATENCY_METRICS:
        stats = summary.latency[name]
        lines.append(f"{_TITLES[name]:-^60}")
        label = name.upper()
        lines.append(f"{'Mean ' + label + ' (ms):':<44}{_ms(stats.mean_ms)}")
        lines.append(f"{'Median ' + label + ' (ms):':<44}{_ms(stats.median_ms)}")
        for p in PERCENTILES:
            if p != 50:
                lines.append(f"{f'P{p} ' + label + ' (ms):':<44}{_ms(stats.percentiles_ms[p])}")
    lines.append("=" * 60)
    return "\n".join(lines)


def result_json(result: LoadResult, summary: Summary, workload_name: str) -> dict[str, Any]:
    """The `--save` document: vLLM's top-level keys and per-request lists, plus our extras
    (`cancelled`, `failures_by_kind`, `workload`)."""
    ok = [r for r in result.records if r.ok]
    config = result.config
    doc: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if config.endpoint == "chat" else "openai",
        "base_url": config.base_url, "model_id": result.model, "workload": workload_name,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness, "max_concurrency": config.max_concurrency, "stream": config.stream,
        "cancel_rate": config.cancel_rate, "seed": config.seed,
        **summary.to_vllm_dict(),
        "input_lens": [r.prompt_tokens for r in ok], "output_lens": [r.output_tokens for r in ok],
        "ttfts": [r.ttft_s for r in ok], "e2els": [r.e2e_s for r in ok], "itls": [itls_s(r) for r in ok],
        "errors": [r.error for r in result.records if r.error_kind is not None],
    }
    # JSON has no NaN: a metric without samples is null.
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in doc.items()}


def save_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _pyplot() -> Any:
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache notice is not a result
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_dir: Path, name: str, dpi: int = 100) -> Path:
    """`fig` laid out and written to OUT_DIR/NAME.png (the directory made if need be), then closed."""
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def plot_latency_cdfs(result: LoadResult, out_dir: Path, label: str = "") -> Path:
    """One PNG, four panels: empirical CDFs of TTFT, TPOT, ITL and E2E (ms)."""
    plt = _pyplot()
    ok = [r for r in result.records if r.ok]
    samples = {"ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
               "tpot": [t for t in map(tpot_s, ok) if t is not None],
               "itl": [g for r in ok for g in itls_s(r)], "e2el": [r.e2e_s for r in ok]}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, samples.items(), strict=True):
        ms = sorted(v * 1000 for v in values)
        if ms:
            ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], drawstyle="steps-post")
        ax.set_title(f"{name.upper()} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests" + (f" ({label})" if label else ""))
    return save_figure(fig, out_dir, "latency_cdf")


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One run of a sweep: its label and x value (concurrency, or number of decode instances)."""

    label: str
    x: float
    summary: Summary


def plot_sweep(points: Sequence[SweepPoint], out_dir: Path, x_label: str, name: str) -> Path:
    """Throughput and P99 latencies against x, on twin axes (the seed's "instances – P99 – throughput")."""
    plt = _pyplot()
    xs = [p.x for p in points]
    fig, left = plt.subplots(figsize=(7, 4.2))
    left.plot(xs, [p.summary.output_throughput for p in points], "o-", color="tab:blue", label="output tok/s")
    left.set_xlabel(x_label)
    left.set_ylabel("output tokens/s", color="tab:blue")
    right = left.twinx()
    for metric, style, color in (("ttft", "s--", "tab:red"), ("tpot", "^--", "tab:orange")):
        right.plot(xs, [p.summary.latency[metric].percentiles_ms[99] for p in points], style, color=color,
                   label=f"P99 {metric.upper()} (ms)")
    right.set_ylabel("P99 latency (ms)")
    right.set_yscale("log")
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = left.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    left.legend(handles, labels, loc="upper left", fontsize=8)
    left.set_xticks(xs, [p.label for p in points])
    left.grid(alpha=0.3)
    return save_figure(fig, out_dir, name)


def format_sweep_table(points: Sequence[SweepPoint], x_header: str) -> tuple[list[str], list[list[str]]]:
    headers = [x_header, "completed", "failed", "req/s", "output tok/s", "TTFT P99 ms", "TPOT median ms",
               "TPOT P99 ms", "E2E P99 ms", "goodput req/s"]
    rows = []
    for p in points:
        s = p.summary
        rows.append([p.label, str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
                     f"{s.output_throughput:.1f}", _ms(s.latency["ttft"].percentiles_ms[99]),
                     _ms(s.latency["tpot"].median_ms), _ms(s.latency["tpot"].percentiles_ms[99]),
                     _ms(s.latency["e2el"].percentiles_ms[99]),
                     "n/a" if s.request_goodput is None else f"{s.request_goodput:.2f}"])
    return headers, rows
