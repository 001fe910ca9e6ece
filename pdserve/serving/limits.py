"""The caps on what one request may ask for (`ApiConfig`), checked before any tokenization or
engine work: a request beyond one gets a 400 naming the cap and the flag that raises it."""

from __future__ import annotations

from http import HTTPStatus

from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import OpenAIError
from pdserve.serving.protocol import ChatCompletionRequest, CompletionRequest


def _cap(value: int, cap: int, param: str, what: str, flag: str) -> None:
    if value > cap:
        raise OpenAIError(f"{param}: {value} {what}, more than the {cap} allowed ({flag})", HTTPStatus.BAD_REQUEST,
                          param)


def requested_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Log-probabilities per token the request asks for; None: none at all."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    return (body.top_logprobs or 0) if body.logprobs else None


def requested_prompt_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Log-probabilities per prompt token the request asks for (`prompt_logprobs`, or on completions
    `echo` with `logprobs`: the echoed prompt's tokens come with theirs); None: none."""
    if not isinstance(body, CompletionRequest):
        return body.prompt_logprobs
    asked = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
    return max(asked, default=None)


def requested_max_tokens(body: CompletionRequest, limit: int | None) -> int | None:
    """A completion's max_tokens; OpenAI's default (16), which the client did not ask for, within `limit`."""
    if "max_tokens" in body.model_fields_set or limit is None or body.max_tokens is None:
        return body.max_tokens
    return min(body.max_tokens, limit)


def check_limits(body: CompletionRequest | ChatCompletionRequest, limits: ApiConfig) -> None:
    """400 for a request beyond `limits`."""
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    _cap(len(stop), limits.max_stop_strings, "stop", "strings", "--max-stop-strings")
    for text in stop:
        _cap(len(text), limits.max_stop_string_len, "stop", "characters in a stop string", "--max-stop-string-len")
    _cap(len(body.stop_token_ids or ()), limits.max_stop_token_ids, "stop_token_ids", "ids", "--max-stop-token-ids")
    _cap(body.n, limits.max_n, "n", "choices", "--max-n")
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) \
            and not all(isinstance(p, int) for p in body.prompt):  # NOTE: a list of ints is one prompt
        _cap(len(body.prompt), limits.max_prompts, "prompt", "prompts", "--max-prompts")
    # NOTE: on chat both caps are checked, though max_completion_tokens wins: the schema bounds both
    if isinstance(body, ChatCompletionRequest):
        asked = {"max_tokens": body.max_tokens, "max_completion_tokens": body.max_completion_tokens}
    else:
        asked = {"max_tokens": requested_max_tokens(body, limits.max_tokens_limit)}
    for param, max_tokens in asked.items():
        if limits.max_tokens_limit is not None and max_tokens is not None:
            _cap(max_tokens, limits.max_tokens_limit, param, "tokens", "--max-tokens-limit")
    if body.prompt_logprobs is not None:
        _cap(body.prompt_logprobs, limits.max_logprobs, "prompt_logprobs", "log-probabilities per token",
             "--max-logprobs")
    logprobs = requested_logprobs(body)
    if logprobs is None:
        return
    _cap(logprobs, limits.max_logprobs, "logprobs" if isinstance(body, CompletionRequest) else "top_logprobs",
         "log-probabilities per token", "--max-logprobs")
