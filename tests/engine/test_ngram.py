"""Prompt-lookup drafts against a plain loop over the request's tokens (written here)."""

from __future__ import annotations

import numpy as np
import pytest

from modeserve.engine.scheduler.ngram import propose_ngram


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest recurring suffix first; its latest earlier occurrence; the k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_equals_the_plain_loop() -> None:
    rng = np.random.default_rng(0)
    found = 0
    for _ in range(1000):  # a small alphabet, so that suffixes recur
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 61))).tolist()
        k, min_n = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        want = reference(tokens, k, min_n, max_n)
        got = propose_ngram(np.array(tokens, dtype=np.int64), k, min_n, max_n)
        assert got.dtype == np.int64 and got.tolist() == want, (tokens, k, min_n, max_n)
        found += bool(want)
    assert 300 < found < 1000  # both outcomes were exercised


def test_examples() -> None:
    def draft(tokens: list[int], k: int = 3, min_n: int = 1, max_n: int = 3) -> list[int]:
        return propose_ngram(np.array(tokens, dtype=np.int64), k, min_n, max_n).tolist()

    assert draft([5, 6, 7, 8, 9, 5, 6]) == [7, 8, 9]  # "5 6" recurs: what followed it
    assert draft([1, 2, 3, 9, 2, 3, 7, 1, 2, 3]) == [9, 2, 3]  # "1 2 3" (at 0) beats the later "2 3"
    assert draft([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], max_n=2) == [7, 1, 2]  # latest "2 3"
    assert draft([4, 4, 4, 4]) == [4]  # the match may overlap the suffix; only what follows it
    assert draft([1, 2, 3, 4]) == [] and draft([7]) == []
    assert draft([1, 2, 1, 2], min_n=3) == []  # no suffix of 3 recurs


def test_bad_bounds_are_value_errors() -> None:
    tokens = np.arange(8, dtype=np.int64)
    for k, lo, hi in ((0, 1, 2), (2, 0, 2), (2, 3, 2)):
        with pytest.raises(ValueError, match="ngram drafts"):
            propose_ngram(tokens, k, lo, hi)


def test_device_drafts_equal_the_plain_loop_filled() -> None:
    """``kernels.chain_verify.ngram_drafts`` (rows of a padded table, each its own length) against the plain
    loop, made up to k by repeating the row's last token (what the tokens run into, or nothing found)."""
    import torch

    from modeserve.kernels.chain_verify import ngram_drafts

    rng = np.random.default_rng(1)
    for _ in range(40):
        k, min_n = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        rows = [rng.integers(0, 4, size=int(rng.integers(1, 41))).tolist() for _ in range(8)]
        width = max(map(len, rows)) + int(rng.integers(0, 5))
        table = torch.from_numpy(rng.integers(0, 4, size=(8, width)))  # junk past each row's length
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(r)
        got = ngram_drafts(table, torch.tensor([len(r) for r in rows]), k, min_n, max_n).tolist()
        for r, g in zip(rows, got):
            want = reference(r, k, min_n, max_n)
            assert g == want + [r[-1]] * (k - len(want)), (r, k, min_n, max_n)
