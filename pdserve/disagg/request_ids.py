"""The ids one request goes by across the cluster; built and parsed here only.

    request id      "cmpl-7f3a"       the API server's, what the client and the logs see
    run id          "cmpl-7f3a~1"     the request again on another decode worker after a decode loss
                                      (resume 1, 2, ...; resume 0 is the request id itself): the id
                                      decode's stream and prefill's job go by
    transfer id     "cmpl-7f3a~1@2"   one prefill attempt of a run (attempt 0, 1, ...): what the KV
                                      receiver expects and the prefill worker computes. A retried or
                                      re-delivered job is a new attempt, so a late payload of an
                                      earlier one can never be counted as part of the current one.
"""

from __future__ import annotations

_RESUME, _ATTEMPT = "~", "@"


def run_id(request_id: str, resume: int) -> str:
    """The id of the request's `resume`-th run (0: the request id itself)."""
    return request_id if resume == 0 else f"{request_id}{_RESUME}{resume}"


def transfer_id(run: str, attempt: int) -> str:
    """The id of prefill attempt `attempt` of a run."""
    return f"{run}{_ATTEMPT}{attempt}"


def request_id_of(tid: str) -> str:
    """The run a transfer id is an attempt of ("" for an id that is none)."""
    return tid.rpartition(_ATTEMPT)[0]


def attempt_of(tid: str) -> int:
    """Which attempt of its run a transfer id is (0 for an id that names none)."""
    return int(tid.rpartition(_ATTEMPT)[2] or 0) if _ATTEMPT in tid else 0
