"""A log of the engine's steps as they ran, for fitting a step-time model to a served workload.

With `PDSERVE_STEP_LOG=DIR` every engine (each worker of `pdserve up`, any role) appends one JSON
line per step to `DIR/steps-<role>-<pid>.jsonl` (`steps-<pid>.jsonl` outside a worker): the
step's wall time, the gap before it while work waited, and the counts of its work in the columns
of `sizing.profile.StepModel` (prefill tokens, prefill pairs, decode sequences, decode context
tokens). `pdserve calibrate --from-step-log FILE...` fits a profile to them: step costs as they
were on the machine while it served (neighbours on the other cores, the API server sharing the
process, the KV transport's threads), which timing steps alone (`pdserve calibrate`) leaves out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, NamedTuple

from pdserve.engine.scheduler_output import ScheduledChunk


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step computed, in `StepModel`'s columns (see sizing/profile.py)."""

    prefill_tokens: int
    prefill_pairs: float
    decode_seqs: int
    decode_context: int

    @classmethod
    def of(cls, chunks: Iterable[ScheduledChunk]) -> StepWork:
        """Counted before the step runs (the chunks' requests still hold their old positions).
        A chunk below its prompt's end is prefill (recomputation after a preemption too)."""
        prefill_tokens, pairs, decode_seqs, context = 0, 0.0, 0, 0
        for chunk in chunks:
            done, new = chunk.request.num_computed_tokens, chunk.num_new_tokens
            if done < chunk.request.num_prompt_tokens:
                prefill_tokens += new
                pairs += new * (done + new / 2)
            else:
                decode_seqs += 1
                context += done + new
        return cls(prefill_tokens, pairs, decode_seqs, context)


class StepLog:
    """Appends `{"seconds": ..., "gap_s": ..., "start_s": ..., <StepWork>}` lines; line-buffered, so
    a killed worker loses at most the step it was in. `gap_s`: from the previous step's end to this
    one's start when the engine still had work then (time lost between steps: handing requests and
    outputs to and from the API server, waiting for the GIL), else null (it was idle). `start_s`:
    the step's start on `time.perf_counter`'s clock, the host's monotonic clock on Linux, so the
    steps of several workers on one host line up (whether one role stepped while the other did)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.role: str | None = None  # a worker's role, named in the file (set before the first step)
        self._file: IO[str] | None = None  # opened at the first step
        self._busy_since: float | None = None  # the last step's end, if work was left then

    @classmethod
    def from_env(cls) -> StepLog | None:
        from pdserve.envs import step_log_dir

        directory = step_log_dir()
        return None if directory is None else cls(Path(directory))

    @property
    def path(self) -> Path:
        return self.directory / "-".join(["steps", *([self.role] if self.role else []), f"{os.getpid()}.jsonl"])

    def record(self, work: StepWork, seconds: float, start: float, busy_after: bool) -> None:
        """One step of `seconds` that began at `start` (perf_counter); `busy_after`: work was left."""
        gap = None if self._busy_since is None else round(start - self._busy_since, 6)
        self._busy_since = start + seconds if busy_after else None
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)
        self._file.write(json.dumps({"seconds": round(seconds, 6), "gap_s": gap, "start_s": round(start, 6),
                                     **asdict(work)}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def step_log_role(path: Path) -> str | None:
    """The worker role a step log's file name carries (`steps-decode-12.jsonl`: decode)."""
    parts = path.stem.split("-")
    return parts[1] if len(parts) == 3 else None


class LoggedStep(NamedTuple):
    """One logged step: its work; its period, its own time plus the gap before it when the engine
    had work waiting (the simulator's steps follow each other with no gap, so that time belongs to
    the step); the worker role that ran it (None outside a worker); and when the period began, on
    the host's monotonic clock (None in a log written before it was recorded)."""

    work: StepWork
    period_s: float
    role: str | None
    start_s: float | None


def read_step_logs(paths: Iterable[Path]) -> list[LoggedStep]:
    """Every logged step of these files (directories: their steps-*.jsonl), in order."""
    out = []
    for path in paths:
        if not Path(path).exists():
            raise ValueError(f"{path}: no such step log (file or directory)")
        files = sorted(Path(path).glob("steps-*.jsonl")) if Path(path).is_dir() else [Path(path)]
        for file in files:
            for number, line in enumerate(file.read_text().splitlines(), 1):
                try:
                    raw = json.loads(line)
                    gap = float(raw.get("gap_s") or 0.0)
                    start = raw.get("start_s")
                    out.append(LoggedStep(StepWork(int(raw["prefill_tokens"]), float(raw["prefill_pairs"]),
                                                   int(raw["decode_seqs"]), int(raw["decode_context"])),
                                          float(raw["seconds"]) + gap, step_log_role(file),
                                          None if start is None else float(start) - gap))
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{file}:{number}: not a step log line ({exc!r})") from None
    return out
