"""What every benchmark prints about where it ran, and the steps several of them share."""

from __future__ import annotations

import os
import platform

import torch

from pdserve.engine.llm_engine import LLMEngine


def hardware_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"{device}")


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def step_until_prompts_are_in(engine: LLMEngine) -> None:
    """Step `engine` until every request it holds has its whole prompt computed (what a benchmark
    of decode steps does, untimed, before it times any)."""
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
