"""Qwen3 tokenization: encode/decode, chat templates, streaming detokenization."""

from pdserve.tokenizer.detokenizer import IncrementalDetokenizer
from pdserve.tokenizer.qwen3_vocab import QWEN3_SPECIAL_TOKENS, write_qwen3_tokenizer_files
from pdserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "QWEN3_SPECIAL_TOKENS",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
    "write_qwen3_tokenizer_files",
]
