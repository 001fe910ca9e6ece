"""Streaming token ids -> text without splitting multi-byte UTF-8 characters."""

from __future__ import annotations

import codecs

from pdserve.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Feed generated ids one at a time; each `push` returns only text that is complete so far.

    Byte-level BPE tokens can end mid-character (CJK, emoji), so bytes are buffered by an incremental UTF-8
    decoder until the character completes; concatenated output equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prefix: bytes = b"") -> None:
        """`prefix`: the start of an unfinished character the first ids complete (a stream that
        continues another one's output, see `pending_bytes`)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces = [self._decoder.decode(prefix)]  # NOTE: joined on reading `text`: a push is O(1)

    def push(self, token_id: int) -> str:
        if not self._decoder.buffer:  # NOTE: nothing pending: a token of whole characters is its cached text
            text = self._tokenizer.token_text(token_id, self._skip_special_tokens)
            if text is not None:
                if text:
                    self._pieces.append(text)
                return text
        return self._emit(self._decoder.decode(self._tokenizer.token_bytes(token_id, self._skip_special_tokens)))

    def flush(self) -> str:
        """End of stream: an unfinished trailing character becomes U+FFFD, as in a full decode."""
        return self._emit(self._decoder.decode(b"", final=True))

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece


def detokenize(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> tuple[str, bytes]:
    """What an `IncrementalDetokenizer` fed `token_ids` has made: its text, and the bytes of an
    unfinished last character it holds back (b"" when the text ends on a whole character)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = "".join(decoder.decode(tokenizer.token_bytes(t, skip_special_tokens)) for t in token_ids)
    return text, bytes(decoder.getstate()[0])
