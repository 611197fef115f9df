"""Chained verify rows (``chain_verify_rows``) as one Triton kernel and as the torch reference, both
against a plain loop over the rows written here: the reserved slots land in the table, the row moves
back to ``fill_len - 1`` (positions, seq_len, slots read back), its first id is the slot's last token
and its drafts are prompt lookup (tests.engine.test_ngram's loop, filled with the last token). Without
a GPU the kernel runs in Triton's CPU interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modeserve.kernels import chain_verify
from modeserve.kernels.triton.chain_verify import chain_verify_rows
from tests.engine.test_ngram import reference as ngram_loop

MAX_REQS, WIDTH = 6, 96


def make_step(seed: int, q: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Tables (req_to_token, token_ids over a 3-token alphabet so suffixes recur, last_token, fill_len)
    and a step of 4 rows, rows 0, 2 and 3 chained (row 1 an ordinary verify row), sent as if their last
    step kept all q - 1 drafts."""
    rng = np.random.default_rng(seed)
    req_to_token = torch.from_numpy(rng.integers(1, 5000, (MAX_REQS, WIDTH)))
    token_ids = torch.from_numpy(rng.integers(0, 3, (MAX_REQS, WIDTH)))
    last_token = torch.from_numpy(rng.integers(0, 3, MAX_REQS))
    slots = [4, 1, 0, 5]
    fill = rng.integers(2, WIDTH - 2 * q, 4)
    fill[3] = 1  # a row with no earlier token: nothing recurs
    fill_len = torch.zeros(MAX_REQS, dtype=torch.int64)
    fill_len[slots] = torch.from_numpy(fill)
    kept = rng.integers(0, q, 4)  # drafts the last step kept: the host's start is q - 1 - kept further on
    host_start = fill - 1 + (q - 1 - kept)
    positions = torch.from_numpy(np.concatenate([np.arange(s, s + q) for s in host_start]))
    seq_lens = torch.from_numpy(host_start + q)
    loc = torch.from_numpy(rng.permutation(np.arange(6000, 7000))[: 4 * q].copy())
    ids = torch.full((4 * q,), -1, dtype=torch.int64)
    ids[q : 2 * q] = torch.from_numpy(rng.integers(0, 3, q))
    chained = [0, 2, 3]
    step = [torch.tensor([slots[r] for r in chained]), torch.tensor(chained),
            torch.tensor([[r * q + j for j in range(q)] for r in chained]), positions, seq_lens, loc, ids]
    return [req_to_token, token_ids, last_token, fill_len], step, int(seq_lens.max())


def loop_reference(tables: list[torch.Tensor], step: list[torch.Tensor], min_n: int, max_n: int) -> list[torch.Tensor]:
    req_to_token, token_ids, last_token, fill_len = (t.clone() for t in tables)
    slots, rows, tokens = step[:3]
    positions, seq_lens, loc, ids = (t.clone() for t in step[3:])
    for slot, row, idx in zip(slots.tolist(), rows.tolist(), tokens.tolist()):
        q = len(idx)
        for i in idx:
            req_to_token[slot, positions[i]] = loc[i]
        start = int(fill_len[slot]) - 1
        seq_lens[row] -= int(positions[idx[0]]) - start
        first = int(last_token[slot])
        history = token_ids[slot, :start].tolist() + [first]
        drafts = ngram_loop(history, q - 1, min_n, max_n)
        drafts += [history[-1]] * (q - 1 - len(drafts))
        for j, i in enumerate(idx):
            positions[i] = start + j
            loc[i] = req_to_token[slot, start + j]
            ids[i] = first if j == 0 else drafts[j - 1]
    return [req_to_token, token_ids, last_token, fill_len, positions, seq_lens, loc, ids]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("q, min_n, max_n", [(5, 1, 3), (2, 1, 1), (7, 2, 4)])
@pytest.mark.parametrize("impl", [chain_verify_rows, chain_verify.chain_verify_rows], ids=["triton", "torch"])
def test_chain_verify_rows_equal_a_loop(impl, seed: int, q: int, min_n: int, max_n: int) -> None:  # noqa: ANN001
    tables, step, width = make_step(seed, q)
    want = loop_reference(tables, step, min_n, max_n)
    impl(*tables, *step, width, min_n, max_n)
    for name, got, w in zip(["req_to_token", "token_ids", "last_token", "fill_len", "positions", "seq_lens",
                             "out_cache_loc", "input_ids"], tables + step[3:], want):
        assert torch.equal(got, w), name


def test_chain_verify_rows_refuses_other_dtypes() -> None:
    tables, step, width = make_step(0, 5)
    step[3] = step[3].int()
    with pytest.raises(ValueError, match="int64"):
        chain_verify_rows(*tables, *step, width, 1, 3)


def test_a_slot_never_verified_stays_inside_the_table() -> None:
    """A batch may chain a slot whose fill_len says nothing (0, or past the table): both implementations
    start it inside the table, at 0 and at the last q positions, and move it alike (its drafts are
    whatever its junk history gives)."""
    for fill, want_start in ((0, 0), (10 * WIDTH, WIDTH - 5)):
        results = []
        for impl in (chain_verify_rows, chain_verify.chain_verify_rows):
            tables, step, width = make_step(0, 5)
            tables[3][step[0]] = fill
            impl(*tables, *step, width, 1, 3)
            results.append([t.clone() for t in tables[:1] + step[3:6]])  # table, positions, seq_lens, slots
            assert step[3][step[2][:, 0]].tolist() == [want_start] * 3
        assert all(torch.equal(a, b) for a, b in zip(*results))
