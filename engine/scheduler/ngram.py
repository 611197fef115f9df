"""Prompt-lookup drafts (speculative decoding's ``"ngram"`` drafter): the tokens that followed the most
recent earlier occurrence of a request's last n tokens, in its own prompt and output, for n from
``max_n`` down to ``min_n`` (the longest suffix that recurs wins). No model: the scheduler proposes
them from the tokens it holds.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``k`` draft tokens for a request whose tokens so far (prompt, then output) are
    ``tokens`` ([L] int64): those after the latest earlier match of its last n tokens; empty when no
    suffix of ``min_n`` to ``max_n`` tokens occurs earlier. ``ValueError`` on bad bounds."""
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"ngram drafts need k >= 1 and 1 <= min_n <= max_n (k={k}, min_n={min_n}, max_n={max_n})")
    length = int(tokens.shape[0])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - n - 1: every earlier place the last n tokens could recur
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the latest match
            return tokens[start:start + k].copy()
    return tokens[:0].copy()
