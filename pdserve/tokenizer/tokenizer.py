"""Text <-> token ids for Qwen3, backed by a model directory's tokenizer.json or the bundled tiktoken vocabulary."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizer

from pdserve.tokenizer.chat_template import QWEN3_CHAT_TEMPLATE, render_chat_template
from pdserve.tokenizer.qwen3_vocab import (
    QWEN3_CONTROL_TOKEN_IDS,
    QWEN3_ENDOFTEXT_ID,
    QWEN3_IM_END_ID,
    bytes_to_unicode,
    qwen3_tiktoken_encoding,
)

_DEFAULT_EOS_TOKEN_IDS = (QWEN3_IM_END_ID, QWEN3_ENDOFTEXT_ID)


class _Backend(Protocol):
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...

    def raw_bytes(self, token_id: int) -> bytes: ...


class _HFBackend:
    """A directory's tokenizer.json, run by the `tokenizers` library (the reference for real checkpoints)."""

    def __init__(self, path: Path) -> None:
        self._tokenizer = HFTokenizer.from_file(str(path))
        added = self._tokenizer.get_added_tokens_decoder()
        self._added_text = {token_id: token.content for token_id, token in added.items()}
        self.special_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def raw_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self._tokenizer.id_to_token(token_id)
        # Vocab entries are byte-level strings: each character stands for one raw byte.
        return b"" if piece is None else bytes(self._byte_of[char] for char in piece)


class _TiktokenBackend:
    """The bundled Qwen vocabulary via tiktoken, for directories without tokenizer files."""

    def __init__(self) -> None:
        self._encoding = qwen3_tiktoken_encoding()
        self.special_ids = QWEN3_CONTROL_TOKEN_IDS
        self.vocab_size = self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        # tokenizer.json applies NFC before BPE; do the same so both backends agree.
        return self._encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        kept = (i for i in token_ids if not (skip_special_tokens and i in self.special_ids))
        # Joined before decoding so characters split across tokens survive; "replace" matches `tokenizers`.
        return b"".join(map(self.raw_bytes, kept)).decode("utf-8", errors="replace")

    def raw_bytes(self, token_id: int) -> bytes:
        # Ids past the vocabulary (the model's embedding table is padded) decode to nothing, as in `tokenizers`.
        if not 0 <= token_id < self.vocab_size:
            return b""
        return self._encoding.decode_single_token_bytes(token_id)


class Tokenizer:
    """Qwen3 tokenizer with Hugging Face semantics.

    - `encode` maps added-token text in the input (e.g. `<|im_start|>` from a rendered chat) to its id and adds
      no BOS/EOS.
    - "Special" means a control token flagged `special` in tokenizer.json (`<|im_end|>`, ...); `<think>` and
      `<tool_call>` are ordinary added tokens and always decode to their text.
    - Ids outside the vocabulary decode to nothing.
    """

    def __init__(self, backend: _Backend, eos_token_ids: tuple[int, ...], chat_template: str) -> None:
        self._backend = backend
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        # token id -> its text, when its bytes are whole UTF-8 characters ("": none), else None; one
        # dict per skip_special_tokens value. Filled as tokens are decoded, bounded by the vocabulary.
        self._texts: tuple[dict[int, str | None], dict[int, str | None]] = ({}, {})

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """Raw UTF-8 bytes of one token (possibly a partial character); b"" for skipped special tokens."""
        if skip_special_tokens and self.is_special(token_id):
            return b""
        return self._backend.raw_bytes(token_id)

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str | None:
        """The text of one token when its bytes (`token_bytes`) are whole UTF-8 characters, else
        None (a partial character: an incremental decoder must buffer it). Cached: an incremental
        detokenizer asks once per generated token."""
        texts = self._texts[skip_special_tokens]
        try:
            return texts[token_id]
        except KeyError:
            pass
        try:
            text: str | None = self.token_bytes(token_id, skip_special_tokens).decode("utf-8")
        except UnicodeDecodeError:
            text = None
        texts[token_id] = text
        return text

    def is_special(self, token_id: int) -> bool:
        return token_id in self._backend.special_ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        **kwargs: Any,
    ) -> str:
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **kwargs,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    # generation_config.json usually lists every stop id ([im_end, endoftext]); config.json often only one.
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids) or _DEFAULT_EOS_TOKEN_IDS


def _chat_template(model_dir: Path) -> str:
    # Newer checkpoints store the template in chat_template.jinja, which transformers prefers over the config.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        # Multi-template configs: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else QWEN3_CHAT_TEMPLATE


def load_tokenizer(model_dir: str | None) -> Tokenizer:
    """Tokenizer for a model directory; falls back to the bundled Qwen3 vocabulary and template."""
    if model_dir is None:
        return Tokenizer(_TiktokenBackend(), _DEFAULT_EOS_TOKEN_IDS, QWEN3_CHAT_TEMPLATE)
    path = Path(model_dir)
    tokenizer_json = path / "tokenizer.json"
    backend: _Backend = _HFBackend(tokenizer_json) if tokenizer_json.is_file() else _TiktokenBackend()
    return Tokenizer(backend, _eos_token_ids(path), _chat_template(path))
