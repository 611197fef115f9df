"""The fused sampling kernel (``kernels.triton.sampling.sample_sorted``) draws the same token as the torch
reference (``kernels.sampling.sample_sorted``) row for row: every filter on and off, cut-offs inside and
across the kernel's blocks and chunks, 64-bit seeds and positions. Without a GPU it runs in Triton's CPU
interpreter; the reference's own semantics are tested against plain Python in
``tests/engine/test_sampler.py``."""

from __future__ import annotations

import pytest
import torch
from modeserve.kernels import sampling
from modeserve.kernels.triton.sampling import BLOCK, CHUNK, sample_sorted


def case(rows: int, vocab: int, device: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Sorted logits and ids with per-row parameters cycling through the filters' corner cases."""
    g = torch.Generator().manual_seed(rows * 31 + vocab)
    scale = torch.tensor([0.05, 0.5, 2.0, 8.0])[torch.arange(rows) % 4]  # from near-flat to peaked rows
    logits = (torch.randn(rows, vocab, generator=g) * scale[:, None]).to(dtype).float()
    logits[0, 5:9] = logits[0].max()  # row 0: a tie at the top
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=True)
    ks = [0, -1, 1, 2, 50, BLOCK - 1, BLOCK, BLOCK + 1, vocab, vocab + 7, 3 * BLOCK // 2, CHUNK - 1, CHUNK, CHUNK + 1]
    ps = [1.0, 0.9, 0.5, 0.999, 1e-4, 0.3, 0.75]
    mins = [0.0, 0.0, 0.05, 0.0, 0.5, 0.01]
    top_ks = torch.tensor([ks[r % len(ks)] for r in range(rows)], dtype=torch.int64)
    top_ps = torch.tensor([ps[r % len(ps)] for r in range(rows)], dtype=torch.float32)
    min_ps = torch.tensor([mins[r % len(mins)] for r in range(rows)], dtype=torch.float32)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g, dtype=torch.int64)
    seeds[:2] = torch.tensor([0, -1])[:rows]
    positions = torch.randint(0, 2**40, (rows,), generator=g, dtype=torch.int64)  # past 32 bits too
    return tuple(t.to(device) for t in (sorted_logits, sorted_ids, top_ks, top_ps, min_ps, seeds, positions))


def check(rows: int, vocab: int, device: str) -> None:
    args = case(rows, vocab, device)
    got = sample_sorted(*args)
    want = sampling.sample_sorted(*args)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()


@pytest.mark.parametrize("rows,vocab", [(3, 7), (30, 3 * BLOCK + 17), (28, 2 * CHUNK + 5), (1, CHUNK)])
def test_fused_sampling_equals_torch_reference(rows: int, vocab: int) -> None:
    check(rows, vocab, "cpu")


def test_fused_sampling_spreads_over_the_kept_set_like_the_reference() -> None:
    """Many seeds over one flat row with every filter on: the draws cover the kept set (the equality
    above is not only about the top token) and equal the reference's draw for draw."""
    rows, vocab = 120, 300
    logits = torch.linspace(1.0, -1.0, vocab).expand(rows, vocab).contiguous()
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).expand(rows, vocab).contiguous()
    args = (logits, ids, torch.full((rows,), 200), torch.full((rows,), 0.6), torch.full((rows,), 0.3),
            torch.arange(rows, dtype=torch.int64) * 7919, torch.full((rows,), 12, dtype=torch.int64))
    got = sample_sorted(*args)
    assert torch.equal(got, sampling.sample_sorted(*args))
    kept = sampling.keep_mask_sorted(logits[:1], *(a[:1] for a in args[2:5]))[0]
    assert 20 < int(kept.sum()) < 200  # top-p cuts before top-k here
    assert set(got.tolist()) <= set(ids[0, kept].tolist())
    assert len(set(got.tolist())) > int(kept.sum()) // 3


def test_fused_sampling_refusals() -> None:
    args = list(case(4, 100, "cpu"))
    assert sample_sorted(*(a[:0] for a in args)).shape == (0,)
    with pytest.raises(ValueError, match="same shape"):
        sample_sorted(args[0], args[1][:, :50], *args[2:])
    with pytest.raises(ValueError, match="int64 ids"):
        sample_sorted(args[0], args[1].to(torch.int32), *args[2:])
    with pytest.raises(ValueError, match=r"contiguous \[4\]"):
        sample_sorted(*args[:2], args[2][:3], *args[3:])
    with pytest.raises(ValueError, match="must be int64"):
        sample_sorted(*args[:5], args[5].to(torch.int32), args[6])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (64, 128256), (256, 151936), (33, 3 * BLOCK + 17)])
def test_fused_sampling_equals_torch_reference_gpu(rows: int, vocab: int) -> None:
    check(rows, vocab, "cuda")
