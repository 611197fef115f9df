"""Tokenizer wrapper, GGUF tokenizer cache and incremental detokenizer, on the real SmolLM2 vocabulary."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator

import pytest

from modeserve.engine import tokenizer as tokenizer_module
from modeserve.engine.default_model import default_model_path
from modeserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "Emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "日本語のテキストと中文混合，还有한국어도 있어요。",
    "Math ∑∫√∞ ≠ ≤ ≥, accents: café naïve Ærøskøbing, Ελληνικά, русский",
    "code: def f(x): return x ** 2  # comment",
    "",
]


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="module")
def tok(cache_home: Path) -> Iterator[Tokenizer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache_home))
        loaded = load_tokenizer(default_model_path())  # converts the GGUF vocabulary and fills the cache
    assert loaded is not None
    yield loaded


def test_properties(tok: Tokenizer) -> None:
    assert tok.name == "SmolLM2-135M-Instruct.Q4_1"
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1  # <|im_start|> in this GGUF; it is not prepended to plain prompts
    assert tok.eos_token_ids == (2,)  # GGUF eos is <|im_end|>, which is also the template's end of turn
    assert tok.hf_tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids == tok.hf_tokenizer(text)["input_ids"]  # same special tokens as tokenizer.__call__ (none here)
    assert tok.decode(ids) == text


def test_decode_special_tokens_and_bad_ids(tok: Tokenizer) -> None:
    ids = [1] + tok.encode("hi") + [2]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([5, 49152])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="expects a str"):
        tok.encode(123)  # type: ignore[arg-type]


def test_chat_template_shape(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template("What is 2+2?")
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template injects a default system prompt
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # special tokens are single ids, none added twice
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "日本?"},
    ]
    text = tok.decode(tok.apply_chat_template(messages), skip_special_tokens=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n日本?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        tok.apply_chat_template([{"role": "user"}])
    no_template = Tokenizer(_WithoutTemplate(tok.hf_tokenizer), name="plain")
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template("hi")


class _WithoutTemplate:
    """Delegates to a real tokenizer but reports no chat template."""

    chat_template = None

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _stream(tok: Tokenizer, ids: list[int], chunk_sizes: Iterator[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    deltas, i = [], 0
    while i < len(ids):
        n = next(chunk_sizes)
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def _check(tok: Tokenizer, ids: list[int], deltas: list[str]) -> None:
    full = tok.decode(ids)
    assert "".join(deltas) == full
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])  # only flush() may end mid-character
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_one_token_at_a_time(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        deltas = _stream(tok, ids, iter(lambda: 1, 0))
        _check(tok, ids, deltas)
        assert "".join(deltas) == text


def test_detokenizer_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    assert detok.flush() == ""
    with pytest.raises(ValueError, match="after flush"):
        detok.push([5])


def test_detokenizer_random_chunks_of_real_text(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    ids = tok.encode("".join(TEXTS) * 2) + [2] + tok.encode("after the special token 🇯🇵")
    for _ in range(30):
        deltas = _stream(tok, ids, iter(lambda: rng.randint(1, 6), 0))
        _check(tok, ids, deltas)


def test_detokenizer_random_slices_of_multibyte_text(tok: Tokenizer) -> None:
    rng = random.Random(7)
    ids = tok.encode(TEXTS[3] + TEXTS[4] + TEXTS[5])
    clean = 0
    for _ in range(200):
        start = rng.randrange(len(ids))
        piece = ids[start : start + rng.randint(1, 30)]  # may start or end inside a character
        deltas = _stream(tok, piece, iter(lambda: rng.randint(1, 3), 0))
        _check(tok, piece, deltas)
        clean += "\ufffd" not in tok.decode(piece)
    assert clean > 50  # the no-U+FFFD-in-deltas property was exercised


def test_detokenizer_random_token_ids(tok: Tokenizer) -> None:
    rng = random.Random(99)
    # byte-level pieces that are not whole characters live high in the vocabulary and in the
    # first 256 ids; mix them with ordinary ids and special tokens.
    pool = list(range(0, 300)) + [rng.randrange(tok.vocab_size) for _ in range(300)]
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        deltas = _stream(tok, ids, iter(lambda: rng.randint(1, 4), 0))
        _check(tok, ids, deltas)


def test_detokenizer_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode("word " * 400)
    detok = IncrementalDetokenizer(tok)
    sizes: list[int] = []
    original = Tokenizer.decode

    def spy(self: Tokenizer, window: Any, skip_special_tokens: bool = True) -> str:
        sizes.append(len(window))
        return original(self, window, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", spy)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    monkeypatch.undo()
    assert text == "word " * 400
    assert max(sizes) <= 2


def test_cache_is_used_on_second_load(tok: Tokenizer, cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = list((cache_home / "modeserve" / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    assert not any(p.name.startswith(".tmp-") for p in entries[0].parent.iterdir())

    def no_conversion(path: Path) -> Any:
        raise AssertionError("the GGUF vocabulary was converted again instead of read from the cache")

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", no_conversion)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    cached = load_tokenizer(default_model_path())
    assert cached is not None
    assert cached.eos_token_ids == tok.eos_token_ids and cached.bos_token_id == tok.bos_token_id
    assert cached.vocab_size == tok.vocab_size and cached.name == tok.name
    for text in TEXTS:
        assert cached.encode(text) == tok.encode(text)
    assert cached.apply_chat_template("hi") == tok.apply_chat_template("hi")
    ids = list(range(0, 49152, 97))
    assert cached.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


def test_unwritable_cache_is_tolerated(tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", lambda path: tok.hf_tokenizer)
    loaded = load_tokenizer(default_model_path())
    assert loaded is not None and loaded.encode("hello") == tok.encode("hello")


def test_folders_and_bad_paths(tok: Tokenizer, tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None  # e.g. a tiny random test model without tokenizer files
    saved = tmp_path / "with-tokenizer"
    tok.hf_tokenizer.save_pretrained(str(saved))
    (saved / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    folder_tok = load_tokenizer(saved)
    assert folder_tok is not None and folder_tok.name == "with-tokenizer"
    assert folder_tok.eos_token_ids == (2, 0)
    assert folder_tok.encode("héllo 😀") == tok.encode("héllo 😀")
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_tokenizer(other)
