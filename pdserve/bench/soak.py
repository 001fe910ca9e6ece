"""`python -m pdserve.bench.soak` (scripts/soak.sh): minutes of mixed load through `pdserve up
--queue redis://…` while things go wrong on a schedule, then proof that nothing was lost.

The run:
- a Redis of its own (append-only file, fsync on every write: a restart keeps the queue) and
  `pdserve up --queue` with P prefill and D decode workers over TCP, float32;
- `--concurrency` client threads send requests drawn from a seeded mix for `--duration` seconds:
  prompts 8-600 tokens, 4-64 output tokens, greedy or seeded sampling, streamed or not; a
  `--cancel-fraction` of them are cancelled at a random point (a stream closed after a random
  number of chunks, a plain request given up after a random time). A 503 or 429 is retried after
  half a second (as the OpenAI SDK does), at most 40 times;
- at 25 % of the duration a prefill worker is SIGKILLed, at 50 % a decode worker, at 75 % Redis
  is restarted (SIGTERM, then started again on its port and directory);
- or, with `--chaos`, a SIGKILL every 15-30 s (seeded) of a random target: a prefill or a decode
  worker's API process or its engine process, at 16 clients by default.

The checks at the end (exit status 1 if any fails):
- every request that was not cancelled got an answer, and that answer is the colocated engine's
  (`LLM.generate` on the same weights and sampling parameters: greedy and seeded alike);
- no worker holds a KV block (prefix-cached free blocks do not count), no queue entry is pending;
- the resident memory of every process there from the start to the end (restarted workers have
  not warmed up) grew < 10 % from the end of the warm-up (default 10 % of the run; keep it before
  the first fault at 25 %).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.soak_load import Load


def main(argv: list[str] | None = None) -> int:
    from pdserve.bench import soak_cluster

    ns = _parser().parse_args(argv)
    if ns.concurrency is None:
        ns.concurrency = 16 if ns.chaos else 6
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    print(f"hardware: {hardware_line()}\nsoak: {ns.duration:g} s, {ns.concurrency} clients, {ns.prefill} prefill + "
          f"{ns.decode} decode, {ns.cancel_fraction:.0%} cancelled{', chaos' if ns.chaos else ''}; logs in {workdir}",
          flush=True)
    with soak_cluster.Cluster.start(ns, workdir) as cluster:
        load = Load(cluster.url, ns.concurrency, ns.cancel_fraction, ns.seed)
        threads = load.run()
        events = cluster.run_schedule(ns.duration, ns.warmup, random.Random(ns.seed) if ns.chaos else None)
        load.stop(threads)
        report = soak_cluster.check(cluster, load.outcomes, ns, events)
    print_table(["check", "result", "ok"], [[r.name, r.value, "yes" if r.ok else "NO"] for r in report])
    if ns.save:
        ns.save.write_text(json.dumps([asdict(r) for r in report], indent=2))
    return 0 if all(r.ok for r in report) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (the schedule scales with it)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the memory baseline (default 10 %%)")
    p.add_argument("--concurrency", type=int, default=None, help="client threads (default 6; 16 with --chaos)")
    p.add_argument("--chaos", action="store_true", help="SIGKILL a random target every 15-30 s instead of the "
                   "fixed schedule")
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded tiny demo model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--save", type=Path, default=None, help="the checks as JSON")
    return p


if __name__ == "__main__":
    sys.exit(main())
