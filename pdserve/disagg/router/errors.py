"""Why the router ends a request, in the cluster's terms. The router's logic raises `RouterError`
with a reason; its edge (`PDRouter.generate`, the EngineClient the OpenAI handlers call) turns it
into the client's status once (`client_error`), so no HTTP status is decided inside the logic.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Literal

from pdserve.serving.errors import OpenAIError

# refused by admission, or while waiting (counted by Admission, as rejections)
Refused = Literal["queue_full", "no_prefill_worker", "no_decode_worker", "no_kv_room", "queue_unavailable",
                  "first_token_timeout"]
Reason = Refused | Literal[
    # ended by a worker's answer
    "decode_refused",  # a decode worker refused the reservation: the request can never run there
    "prefill_refused",  # a prefill worker refused the job for good (`worker_status` says how)
    "kv_failed",  # the KV hand-off failed on decode, which ended the request
    "decode_broke",  # decode workers lost the request more often than resumes allow, or answered wrongly
]

_STATUS: dict[str, HTTPStatus] = {
    "queue_full": HTTPStatus.TOO_MANY_REQUESTS,
    "no_prefill_worker": HTTPStatus.SERVICE_UNAVAILABLE,
    "no_decode_worker": HTTPStatus.SERVICE_UNAVAILABLE,
    "no_kv_room": HTTPStatus.SERVICE_UNAVAILABLE,
    "queue_unavailable": HTTPStatus.SERVICE_UNAVAILABLE,
    "first_token_timeout": HTTPStatus.SERVICE_UNAVAILABLE,
    "decode_refused": HTTPStatus.BAD_REQUEST,
    "kv_failed": HTTPStatus.SERVICE_UNAVAILABLE,
    "decode_broke": HTTPStatus.BAD_GATEWAY,
}
_RETRY_AFTER_S = 1
# 503s a client should retry shortly (a worker may be back by then): with Retry-After too
_RETRY_LATER = frozenset({"no_prefill_worker", "no_decode_worker", "no_kv_room", "queue_unavailable"})


class RouterError(Exception):
    """The router ends a request for `reason` (a prefill refusal carries the worker's own status)."""

    def __init__(self, reason: Reason, message: str, worker_status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.worker_status = worker_status

    def client_error(self) -> OpenAIError:
        """What the client gets: the status for the reason (a prefill refusal: the worker's status),
        Retry-After on a 429 and on a 503 for want of a worker or KV room."""
        status = HTTPStatus(self.worker_status) if self.worker_status is not None else _STATUS[self.reason]
        retry = {"Retry-After": str(_RETRY_AFTER_S)} if status == HTTPStatus.TOO_MANY_REQUESTS \
            or self.reason in _RETRY_LATER else None
        return OpenAIError(self.message, status, headers=retry)
