"""``record_tokens`` (a step's token bookkeeping) as one Triton kernel equals the torch reference,
and both equal a plain loop over the rows: placeholder ids (-1) take the slot's last sampled token,
each token's KV slot and id land at (row, position), nothing else changes. Without a GPU the
kernel runs in Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch
from modeserve.kernels import ops
from modeserve.kernels.triton.slots import record_tokens


def make_step(n: int, device: str, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tables: req_to_token, token_ids, last_token; step: rows, positions, loc, ids) with a MIXED-like
    step: one row extends several positions, the others decode with placeholders."""
    g = torch.Generator().manual_seed(seed)
    tables = [torch.randint(0, 1000, (6, 40), generator=g), torch.randint(0, 1000, (6, 40), generator=g),
              torch.randint(0, 1000, (6,), generator=g)]
    rows = torch.tensor(([2] * max(n - 3, 0) + [0, 5, 3])[:n])
    positions = torch.cat([torch.arange(max(n - 3, 0)) + 4, torch.tensor([17, 39, 0])])[:n]
    loc = torch.randperm(500, generator=g)[:n] + 1
    ids = torch.randint(0, 1000, (n,), generator=g)
    ids[-min(n, 2):] = -1  # the decoding rows' tokens are still being sampled
    return [t.to(device) for t in tables], [t.to(device) for t in (rows, positions, loc, ids)]


def many_rows_step(n: int, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """n decoding rows (more than one program), every other one a placeholder."""
    tables = [torch.zeros(n, 4, dtype=torch.int64), torch.zeros(n, 4, dtype=torch.int64),
              torch.arange(n, dtype=torch.int64) * 3]
    step = [torch.arange(n), torch.arange(n) % 4, torch.arange(n) + 10,
            torch.where(torch.arange(n) % 2 == 0, -1, torch.arange(n))]
    return [t.to(device) for t in tables], [t.to(device) for t in step]


def loop_reference(tables: list[torch.Tensor], step: list[torch.Tensor]) -> list[torch.Tensor]:
    req_to_token, token_ids, last_token = (t.clone() for t in tables)
    rows, positions, loc, ids = (t.tolist() for t in step)
    resolved = []
    for r, p, slot, tok in zip(rows, positions, loc, ids):
        tok = int(last_token[r]) if tok < 0 else tok
        resolved.append(tok)
        req_to_token[r, p], token_ids[r, p] = slot, tok
    return [req_to_token, token_ids, last_token, torch.tensor(resolved, dtype=torch.int64)]


@pytest.mark.parametrize("n", [1, 3, 9, 1500])
@pytest.mark.parametrize("impl", [record_tokens, ops.record_tokens], ids=["triton", "torch"])
def test_record_tokens_equals_a_loop(impl, n: int) -> None:  # noqa: ANN001
    tables, step = make_step(n, "cpu") if n <= 9 else many_rows_step(n, "cpu")
    expected = loop_reference(tables, step)
    impl(*tables, *step)
    for got, want in zip(tables + [step[3]], expected):
        assert torch.equal(got, want)


def test_record_tokens_refusals() -> None:
    tables, step = make_step(4, "cpu")
    with pytest.raises(ValueError, match="int64"):
        record_tokens(*tables, step[0].to(torch.int32), *step[1:])
    with pytest.raises(ValueError, match="one length"):
        record_tokens(*tables, step[0][:3], *step[1:])
    record_tokens(*tables, *(t[:0] for t in step))  # an empty step changes nothing


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 300])
def test_record_tokens_gpu(n: int) -> None:
    tables, step = make_step(n, "cuda", seed=n) if n <= 9 else many_rows_step(n, "cuda")
    expected = loop_reference([t.cpu() for t in tables], [t.cpu() for t in step])
    record_tokens(*tables, *step)
    for got, want in zip(tables + [step[3]], expected):
        assert torch.equal(got.cpu(), want)
