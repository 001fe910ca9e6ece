"""What the OpenAI handlers need from whatever executes requests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer


class EngineClient(Protocol):
    """Implemented by `AsyncLLM` (an engine on a thread of this process: colocated serving) and by
    the PD router's client (prefill and decode workers elsewhere). Called on the event loop.

    `generate` yields cumulative outputs, the last one finished; closing it early aborts the
    request wherever it runs and frees its KV blocks. `validate_request` raises ValueError for a
    request that can never run, before anything is enqueued.
    """

    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int  # the model's: a prompt's token ids are below it
    model_path: str

    @property
    def alive(self) -> bool: ...

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...
