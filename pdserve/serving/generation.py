"""What completions and chat share: running one engine request per prompt, merging their
streams, turning cumulative outputs into per-choice deltas, and counting usage."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus

from pdserve.engine.async_llm import EngineDeadError, RequestFailedError
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.engine_client import EngineClient
from pdserve.serving.errors import OpenAIError
from pdserve.serving.protocol import UsageInfo
from pdserve.tokenizer import Tokenizer


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def encode_text(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    """The tokens of `text`, or a 400 for text that is no valid Unicode (a lone surrogate such as
    "\\ud800", which JSON allows and the tokenizer refuses). Slow for long text: call it off the loop."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OpenAIError(f"{param}: not valid Unicode (a lone surrogate at character {exc.start})",
                          HTTPStatus.BAD_REQUEST, param) from exc
    return tokenizer.encode(text)


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                       limit: int | None = None, prompt_param: str = "prompt") -> int:
    """400 when the prompt plus the requested completion cannot fit the context window; no request
    means what the window leaves, at most `limit` (--max-tokens-limit). `prompt_param`: what the
    request calls its prompt (a chat's is its `messages`)."""
    if prompt_len >= max_model_len:
        raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                          f"has {prompt_len} tokens.", HTTPStatus.BAD_REQUEST, prompt_param)
    if requested is None:
        return min(max_model_len - prompt_len, limit or max_model_len)
    if prompt_len + requested > max_model_len:
        raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                          f"completion). Please reduce the prompt or max_tokens.", HTTPStatus.BAD_REQUEST,
                          "max_tokens")
    return requested


@dataclass(frozen=True, slots=True)
class Job:
    """One engine request: a prompt with its sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


async def run_jobs(client: EngineClient, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (job index, cumulative output) from all jobs as they arrive. Closing this iterator
    (client disconnect) closes every engine stream, which aborts their requests."""
    if len(jobs) == 1:
        async for output in _engine_stream(client, jobs[0]):
            yield 0, output
        return
    merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, job: Job) -> None:
        try:
            async for output in _engine_stream(client, job):
                await merged.put((index, output))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await merged.put(exc)
            raise
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _engine_stream(client: EngineClient, job: Job) -> AsyncIterator[RequestOutput]:
    try:
        async for output in client.generate(job.request_id, job.prompt_token_ids, job.params):
            yield output
    except ValueError as exc:
        raise OpenAIError(str(exc), HTTPStatus.BAD_REQUEST) from exc
    except EngineDeadError as exc:
        raise OpenAIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE) from exc
    except RequestFailedError as exc:
        raise OpenAIError(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR) from exc


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class DeltaTracker:
    """Remembers how much of each choice was already sent. Choice index = job * n + sequence."""

    n: int
    _sent_text: dict[int, int] = field(default_factory=dict)
    _sent_tokens: dict[int, int] = field(default_factory=dict)
    _finished: set[int] = field(default_factory=set)

    def deltas(self, job_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        result = []
        for seq in output.outputs:
            choice = job_index * self.n + seq.index
            if choice in self._finished:
                continue
            text_from = self._sent_text.get(choice, 0)
            token_from = self._sent_tokens.get(choice, 0)
            if not seq.finished and len(seq.text) == text_from and len(seq.token_ids) == token_from:
                continue
            self._sent_text[choice] = len(seq.text)
            self._sent_tokens[choice] = len(seq.token_ids)
            if seq.finished:
                self._finished.add(choice)
            result.append(ChoiceDelta(choice, seq.text[text_from:], seq.token_ids[token_from:],
                                      seq.logprobs[token_from:] if seq.logprobs is not None else None,
                                      seq.finish_reason, seq.stop_reason))
        return result


def usage_of(outputs: dict[int, RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
    completion = sum(len(seq.token_ids) for o in outputs.values() for seq in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})
