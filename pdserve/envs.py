"""Every environment variable pdserve reads, in one place."""

from __future__ import annotations

import os
import sys

_DEFAULT_KV_TRANSFER_TIMEOUT_MS = 100


def kv_transfer_timeout_ms() -> int:
    """KV_TRANSFER_TIMEOUT_MS: how long a KV hand-off may go without progress (default 100)."""
    raw = os.environ.get("KV_TRANSFER_TIMEOUT_MS")
    if raw is None:
        return _DEFAULT_KV_TRANSFER_TIMEOUT_MS
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"KV_TRANSFER_TIMEOUT_MS must be an integer number of milliseconds, got {raw!r}") from exc
    if value < 1:
        raise ValueError(f"KV_TRANSFER_TIMEOUT_MS must be >= 1, got {value}")
    return value


def cache_dir(default: str) -> str:
    """PDSERVE_CACHE_DIR: where the demo checkpoint is built once."""
    return os.environ.get("PDSERVE_CACHE_DIR", default)


STEP_LOG = "PDSERVE_STEP_LOG"


def step_log_dir() -> str | None:
    """PDSERVE_STEP_LOG=DIR: every engine appends its steps to DIR/steps-<pid>.jsonl
    (engine/step_log.py; `pdserve calibrate --from-step-log` fits a profile to them)."""
    return os.environ.get(STEP_LOG) or None


HEAP_TUNING = "PDSERVE_HEAP_TUNING"


def heap_tuning() -> bool:
    """PDSERVE_HEAP_TUNING=0 turns off the glibc tuning of engine/host_memory.py (large temporaries
    kept on a heap that is never trimmed): a process that builds many engines one after another
    (a test run) keeps its memory bounded that way, at the cost of re-faulted pages per step."""
    return os.environ.get(HEAP_TUNING, "1") != "0"


TP_RANK_POOLS = "PDSERVE_TP_RANK_POOLS"


def tp_rank_pools() -> bool:
    """PDSERVE_TP_RANK_POOLS=1: on CPU, each tensor-parallel rank gets a KV pool of its own, holding
    its heads, as on CUDA (default: one pool the ranks share). A prefill worker's ranks then each
    send their own heads (disagg/worker/rank_streaming.py): the GPU path, run on a CPU (tests, benchmarks)."""
    return os.environ.get(TP_RANK_POOLS, "0") == "1"


SUPERVISOR_PID = "PDSERVE_SUPERVISOR_PID"


def supervisor_pid() -> int | None:
    """PDSERVE_SUPERVISOR_PID: set by `pdserve up` on its children; a child whose supervisor is
    gone drains and exits instead of running on as an orphan nobody stops."""
    raw = os.environ.get(SUPERVISOR_PID)
    return int(raw) if raw and raw.isdigit() else None


ENGINE_IN_PROCESS = "PDSERVE_ENGINE_IN_PROCESS"


def engine_in_process() -> bool:
    """PDSERVE_ENGINE_IN_PROCESS=1: a colocated `pdserve serve` (and the tests' servers) runs its
    engine on a thread of the API process, as it once always ran (default: in its own process); the
    same as `--engine-in-process`."""
    return os.environ.get(ENGINE_IN_PROCESS, "0") == "1"


TEST_FAIL_MODEL_STEP = "PDSERVE_TEST_FAIL_MODEL_STEP"


def test_fail_model_step() -> int | None:
    """PDSERVE_TEST_FAIL_MODEL_STEP=N, TESTS ONLY (unset: off): `pdserve serve`'s model step raises
    from its N-th call on, so process tests can watch a worker whose engine broke drain and exit."""
    raw = os.environ.get(TEST_FAIL_MODEL_STEP)
    return int(raw) if raw and raw.isdigit() and int(raw) > 0 else None


API_KEY = "PDSERVE_API_KEY"


def api_keys() -> tuple[str, ...]:
    """PDSERVE_API_KEY: the clients' key (several: separated by commas), added to --api-key's."""
    return tuple(key.strip() for key in os.environ.get(API_KEY, "").split(",") if key.strip())


CLUSTER_SECRET = "PDSERVE_CLUSTER_SECRET"


def cluster_secret() -> str | None:
    """PDSERVE_CLUSTER_SECRET: the cluster secret when --cluster-secret-file is not given (`pdserve
    up` sets it on its children); unset or empty: none."""
    return os.environ.get(CLUSTER_SECRET) or None


SWITCH_INTERVAL_S = 0.0005


def serving_switch_interval() -> None:
    """A serving process's threads (the event loop, the engine-core link's reader and writer, the KV
    side's loop, the transports' I/O threads) hand the GIL to each other often, each for a small
    piece of work: at Python's default (a waiting thread may wait 5 ms for a busy one to yield) a
    PD request's hops between the API and engine processes cost 3-6 ms of its first token on a
    2-vCPU machine (docs/BENCHMARKS.md, "The engine process of prefill and decode workers")."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
