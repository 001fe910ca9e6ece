"""What the OpenAI API admits (`ApiConfig`): client keys and input caps, for the colocated server
and the router alike. Built once at the edge, frozen, passed down; flags from the fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.config import knob


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """What the OpenAI API (colocated `serve`, `router`) admits: client keys and input caps. A
    request beyond a cap gets a 400 (a body beyond --max-request-body-bytes a 413) before any work."""

    api_key: tuple[str, ...] = knob((), "client key: every /v1/* route, /workers, /router/stats and /dashboard "
                                        "need 'Authorization: Bearer KEY' (repeatable; it shows in `ps`: prefer "
                                        "--api-key-file or env PDSERVE_API_KEY)")
    api_key_file: str | None = knob(None, "file of client keys, one a line (blank lines and # comments skipped)")
    max_request_body_bytes: int = knob(8 << 20, "request bodies larger than this get a 413, unread")
    max_stop_strings: int = knob(64, "most `stop` strings a request may have")
    max_stop_string_len: int = knob(1024, "longest `stop` string, in characters")
    max_stop_token_ids: int = knob(64, "most `stop_token_ids` a request may have")
    max_tokens_limit: int | None = knob(None, "most tokens one completion may ask for (default: what the context "
                                              "window leaves after the prompt)")
    max_n: int = knob(64, "most choices (`n`) per prompt")
    max_prompts: int = knob(256, "most prompts in one /v1/completions request (each is an engine request)")
    max_logprobs: int = knob(20, "most `logprobs` / `top_logprobs` per token")
    reasoning_parser: Literal["qwen3"] | None = knob(None, "chat answers' <think>...</think> part goes to "
                                                           "message.reasoning_content (delta.reasoning_content)")
    enable_auto_tool_choice: bool = knob(False, "let the model call a chat request's `tools` on its own "
                                                "(tool_choice auto); needs --tool-call-parser")
    tool_call_parser: Literal["hermes"] | None = knob(None, "how tool calls are read from chat answers (hermes: "
                                                            "Qwen3's <tool_call>{...}</tool_call>); needed for tools")

    def validate(self) -> None:
        caps = {"max_request_body_bytes": self.max_request_body_bytes, "max_stop_strings": self.max_stop_strings,
                "max_stop_string_len": self.max_stop_string_len, "max_stop_token_ids": self.max_stop_token_ids,
                "max_n": self.max_n, "max_prompts": self.max_prompts,
                "max_tokens_limit": 1 if self.max_tokens_limit is None else self.max_tokens_limit}
        for name, value in caps.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if any(not key or any(c.isspace() for c in key) for key in self.api_key):
            raise ValueError("an API key must be non-empty and have no whitespace")

    def api_keys(self) -> tuple[str, ...]:
        """--api-key, the lines of --api-key-file and PDSERVE_API_KEY together; none: no authentication."""
        from pdserve import envs

        keys = list(self.api_key)
        if self.api_key_file is not None:
            with open(self.api_key_file, encoding="utf-8") as lines:
                keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return tuple(dict.fromkeys([*keys, *envs.api_keys()]))
