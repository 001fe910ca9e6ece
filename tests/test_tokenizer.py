"""pdserve.tokenizer: backend agreement (tiktoken vs tokenizer.json vs transformers), chat template, streaming."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer, write_qwen3_tokenizer_files

IM_START, IM_END, ENDOFTEXT, THINK = 151644, 151645, 151643, 151667

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say WE'VE done it, don't you think? She'd've",
    'def add(a: int, b: int) -> int:\n    """Add."""\n    return a + b  # sum\n\n\nprint(add(1, 2))\n',
    "for (int i = 0; i < n; ++i) {\r\n\tx[i] = y[i] * 2;\r\n}",
    "你好，世界！这是一个用于测试分词器的中文句子。",
    "日本語のテキストと한국어 텍스트, and العربية too.",
    "emoji: 😀👍🏽👨‍👩‍👧‍👦 🇺🇸🇯🇵 ❤️",
    "   leading spaces, trailing spaces   ",
    "a\n\n\n\nb \t \t c\n  \n   \n",
    "1234567890 3.14159 -42 1e-9 0x1F 2024-06-01 1,000,000",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nEasy.\n</think>\n\n4<|im_end|>",
    "call <tool_call>\n{\"name\": \"f\"}\n</tool_call> then <|endoftext|>text<|fim_prefix|>",
    "café vs cafe\u0301, Å vs A\u030a",  # decomposed forms: NFC must be applied by both backends
    "",
]

# Characters likely to hit rare merges: multi-byte scripts, combining marks, symbols, whitespace.
_RANDOM_POOL = "ab Z9_-.,'\n\t  éßøΩжא中文字😀🎉€→\u0301\u200d<>|{}"


def _random_corpus(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_RANDOM_POOL) for _ in range(rng.randint(1, 60))) for _ in range(count)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    write_qwen3_tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(model_dir: Path) -> Tokenizer:
    return load_tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def tt_tok() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(params=["tiktoken", "tokenizer.json"])
def tok(request: pytest.FixtureRequest, tt_tok: Tokenizer, hf_tok: Tokenizer) -> Tokenizer:
    return tt_tok if request.param == "tiktoken" else hf_tok


def test_written_files_are_exactly_the_hf_pair(model_dir: Path) -> None:
    assert sorted(p.name for p in model_dir.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    assert config["added_tokens_decoder"]["151645"]["special"] is True
    assert config["added_tokens_decoder"]["151667"]["special"] is False


def test_known_ids(tok: Tokenizer) -> None:
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert tok.encode("<|im_start|>user<|im_end|><think>") == [IM_START, 872, IM_END, THINK]
    assert tok.vocab_size == 151669


def test_backends_agree(tt_tok: Tokenizer, hf_tok: Tokenizer) -> None:
    for text in CORPUS + _random_corpus(300):
        assert tt_tok.encode(text) == hf_tok.encode(text), text


def test_decode_round_trip(tok: Tokenizer) -> None:
    # Decomposed accents come back NFC-composed, by design (tokenizer.json normalizes).
    for text in filter(lambda t: unicodedata.is_normalized("NFC", t), CORPUS):
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_decode_skips_only_control_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\nHi<|im_end|>")
    assert tok.decode(ids) == "assistant\n<think>\nx\n</think>\n\nHi"
    assert tok.is_special(IM_END) and not tok.is_special(THINK)
    assert tok.token_bytes(IM_END) == b"" and tok.token_bytes(IM_END, skip_special_tokens=False) == b"<|im_end|>"
    assert tok.decode([9707, 151900]) == "Hello"  # padded-embedding ids past the vocab decode to nothing


def test_transformers_reference_matches(model_dir: Path, hf_tok: Tokenizer) -> None:
    # Skipped only where the optional reference is not installed; once installed, a directory it
    # cannot load is a failure (our tokenizer files would be unusable for HF users too).
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for text in CORPUS + _random_corpus(50, seed=1):
        ids = reference.encode(text, add_special_tokens=False)
        assert hf_tok.encode(text) == ids, text
        assert hf_tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for enable_thinking in (True, False):
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        assert hf_tok.apply_chat_template(messages, enable_thinking=enable_thinking) == expected


def test_eos_ids_from_model_configs(tmp_path: Path) -> None:
    assert load_tokenizer(str(tmp_path)).eos_token_ids == (IM_END, ENDOFTEXT)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_tokenizer(str(tmp_path)).eos_token_ids == (IM_END, ENDOFTEXT, 7)


CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
]
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chat_template_thinking_switch(tt_tok: Tokenizer) -> None:
    assert tt_tok.apply_chat_template(CHAT) == CHAT_PROMPT
    assert tt_tok.apply_chat_template(CHAT, enable_thinking=False) == CHAT_PROMPT + "<think>\n\n</think>\n\n"
    assert tt_tok.apply_chat_template(CHAT, add_generation_prompt=False) == CHAT_PROMPT.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_chat_template_history_and_parts(tt_tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "<think>\nsecret\n</think>\n\nfour"},
        {"role": "user", "content": "thanks"},
    ]
    assert tt_tok.apply_chat_template(messages) == (
        "<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\nfour<|im_end|>\n"  # reasoning of past turns is dropped
        "<|im_start|>user\nthanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_tool_turns(tt_tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w", "arguments": {"c": "é"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    assert tt_tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nweather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "w", "arguments": {"c": "é"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    )


def test_directory_chat_template_wins(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    tok = load_tokenizer(str(tmp_path))
    assert tok.apply_chat_template(CHAT) == "[system]You are a helpful assistant.[user]What is 2+2?"
    with pytest.raises(ValueError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty"),
        ([{"role": "wizard", "content": "hi"}], "invalid role"),
        ([{"role": "user"}], "missing 'content'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only .*text.* parts"),
        (["hello"], "mapping"),
    ],
)
def test_bad_messages_raise(tt_tok: Tokenizer, messages: list[object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        tt_tok.apply_chat_template(messages)


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(token_id) for token_id in ids] + [detok.flush()]
    assert detok.text == "".join(pieces)
    return pieces


def test_detokenizer_never_splits_characters(tok: Tokenizer) -> None:
    text = "模型说：你好😀！👨‍👩‍👧 emoji🎉🇯🇵 and 中文混合 text<|im_end|>"
    ids = tok.encode(text)
    partial = [i for i in ids if not _is_utf8(tok.token_bytes(i))]
    assert partial, "corpus must contain tokens holding partial characters"
    for skip in (True, False):
        pieces = _stream(tok, ids, skip)
        assert not any("\ufffd" in piece for piece in pieces)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_flush_replaces_truncated_character(tok: Tokenizer) -> None:
    # A newer emoji, which the vocabulary spells with single-byte tokens.
    first = next(i for i in tok.encode("🫠") if not _is_utf8(tok.token_bytes(i)))
    detok = IncrementalDetokenizer(tok)
    assert detok.push(9707) == "Hello"
    assert detok.push(first) == ""
    assert detok.flush() == "\ufffd"
    assert detok.text == "Hello\ufffd"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_stream_continued_mid_character_loses_nothing(tt_tok: Tokenizer) -> None:
    """A resumed request's text starts from the bytes of the character its first stream left
    unfinished (pending_bytes -> utf8_prefix), so the two texts add up to the whole decode."""
    from pdserve.tokenizer.detokenizer import detokenize

    def pending_bytes(tok: Tokenizer, ids: list[int]) -> bytes:
        return detokenize(tok, ids)[1]

    ids = tt_tok.encode("数据🙂 transistor 変数 Ωmega 😀😀")
    splits = [i for i in range(1, len(ids)) if pending_bytes(tt_tok, ids[:i])]
    assert splits, "no token of this text ends mid-character: pick another text"
    for i in splits:
        first = IncrementalDetokenizer(tt_tok)
        head = "".join(first.push(t) for t in ids[:i])
        second = IncrementalDetokenizer(tt_tok, prefix=pending_bytes(tt_tok, ids[:i]))
        tail = "".join(second.push(t) for t in ids[i:]) + second.flush()
        assert head + tail == tt_tok.decode(ids)
        plain = IncrementalDetokenizer(tt_tok)  # what a resume did before: the character is lost
        assert head + "".join(plain.push(t) for t in ids[i:]) + plain.flush() != tt_tok.decode(ids)
