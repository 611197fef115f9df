"""Streamed text deltas: they concatenate to the full decode, never split a character, and hold
back a possible stop string until it is known."""

from __future__ import annotations

import random

import pytest

from modeserve.engine.default_model import default_model_path
from modeserve.engine.tokenizer import Tokenizer, load_tokenizer
from modeserve.service.router.text_stream import TextStream


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = load_tokenizer(default_model_path())
    assert t is not None
    return t


@pytest.mark.parametrize("text", ["Paris is the capital of France. Ünïcödé ✓ 東京 🙂 done",
                                  "no stop here at all, just words and émojis 🎉🎉"])
def test_deltas_concatenate_to_the_text_without_stop(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    rng = random.Random(0)
    stream, out, i = TextStream(tok, stop=["<never>"]), [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        delta = stream.push(ids[i : i + n])
        assert "\ufffd" not in delta
        out.append(delta)
        i += n
    out.append(stream.finish())
    assert "".join(out) == tok.decode(ids)


def test_stop_string_is_held_back_and_cut(tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is Paris, of course.")
    stream = TextStream(tok, stop=["Paris"])
    sent = ""
    for k, t in enumerate(ids, start=1):  # as the scheduler does: stop at the token completing "Paris"
        sent += stream.push([t])
        if "Paris" in tok.decode(ids[:k]):
            break
    assert "Paris" not in sent and not sent.endswith(("P", "Pa", "Par", "Pari"))
    assert sent + stream.finish() == "The capital of France is "
