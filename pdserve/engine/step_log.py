"""A log of the engine's steps as they ran, for fitting a step-time model to a served workload.

With `PDSERVE_STEP_LOG=DIR` every engine (each worker of `pdserve up`, any role) appends one JSON
line per step to `DIR/steps-<pid>.jsonl`: the step's wall time and the counts of its work in the
columns of `sizing.profile.StepModel` (prefill tokens, prefill pairs, decode sequences, decode
context tokens). `pdserve calibrate --from-step-log FILE...` fits a profile to them: step costs as
they were on the machine while it served (neighbours on the other cores, the API server sharing
the process, the KV transport's threads), which timing steps alone (`pdserve calibrate`) leaves out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from pdserve.engine.scheduler import ScheduledChunk


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
    """Appends `{"seconds": ..., <StepWork>}` lines; line-buffered, so a killed worker loses at
    most the step it was in."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("a", buffering=1)

    @classmethod
    def from_env(cls) -> StepLog | None:
        from pdserve.envs import step_log_dir

        directory = step_log_dir()
        return None if directory is None else cls(Path(directory) / f"steps-{os.getpid()}.jsonl")

    def record(self, work: StepWork, seconds: float) -> None:
        self._file.write(json.dumps({"seconds": round(seconds, 6), **asdict(work)}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_logs(paths: Iterable[Path]) -> list[tuple[StepWork, float]]:
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
                    out.append((StepWork(int(raw["prefill_tokens"]), float(raw["prefill_pairs"]),
                                         int(raw["decode_seqs"]), int(raw["decode_context"])), float(raw["seconds"])))
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{file}:{number}: not a step log line ({exc!r})") from None
    return out
