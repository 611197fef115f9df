"""The prefix split of a paged prefill step (``kernels/attention/prefix_split.py``): which steps it cuts,
that the segments and the main plan's rows cover each request's pages exactly once, and that attention
over them, merged by log-sum-exp, equals plain causal attention (a float64 torch reference; FlashInfer's
kernels run on the plan in the GPU test)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from modeserve.kernels.attention.prefix_split import SplitRule, plan_prefix_split

SMS, HEADS = 132, 32


def table(seq: list[int], page: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A CSR page table of requests of these lengths on shuffled pages."""
    counts = [-(-s // page) for s in seq]
    indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    indices = np.random.default_rng(seed).permutation(int(indptr[-1]) + 7)[: indptr[-1]].astype(np.int32) + 1
    last = np.array([s - (c - 1) * page for s, c in zip(seq, counts)], dtype=np.int32)
    return indptr, indices, last


def mixed(chunk: int, prefix: int, decoders: int = 32, decoder_kv: int = 300) -> tuple[list[int], list[int]]:
    return [prefix] + [decoder_kv - 1] * decoders, [chunk] + [1] * decoders


def test_a_few_hundred_queries_over_a_long_prefix_are_cut() -> None:
    prefix, ext = mixed(288, 16384)
    seq = [p + e for p, e in zip(prefix, ext)]
    indptr, indices, last = table(seq, 16)
    split = plan_prefix_split(indptr, indices, last, prefix, ext, 16, HEADS, SMS)
    assert split is not None and split.rows == [0] and 2 <= split.segments <= 16
    np.testing.assert_array_equal(split.query_index, np.arange(288))
    seg_indptr, seg_indices, seg_last = split.prefix
    main_indptr, main_indices, main_last = split.main
    # request 0: its segments in order, then what the main plan keeps, are its pages
    pieces = [seg_indices[seg_indptr[s]: seg_indptr[s + 1]] for s in range(split.segments)]
    kept = main_indices[main_indptr[0]: main_indptr[1]]
    np.testing.assert_array_equal(np.concatenate(pieces + [kept]), indices[indptr[0]: indptr[1]])
    assert all(len(p) * 16 >= SplitRule().min_segment for p in pieces)
    assert (seg_last == 16).all() and np.diff(split.prefix_qo_indptr).tolist() == [288] * split.segments
    np.testing.assert_array_equal(main_last, last)
    for r in range(1, len(seq)):  # the decode rows are untouched
        np.testing.assert_array_equal(main_indices[main_indptr[r]: main_indptr[r + 1]], indices[indptr[r]: indptr[r + 1]])


@pytest.mark.parametrize("prefix, ext", [
    ([28672], [4096]),  # a big chunk: 32 tiles of 128 queries a head already fill the SMs
    ([1500], [288]),  # a prefix shorter than min_prefix
    mixed(1, 16384),  # decode rows are never cut
    ([0, 0], [288, 300]),  # no prefix at all
])
def test_steps_with_work_for_every_sm_or_no_long_prefix_are_not_cut(prefix: list[int], ext: list[int]) -> None:
    seq = [p + e for p, e in zip(prefix, ext)]
    indptr, indices, last = table(seq, 16)
    assert plan_prefix_split(indptr, indices, last, prefix, ext, 16, HEADS, SMS) is None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [E, H, D], natural log-sum-exp [E, H]) of one request; causal aligned to the end of its keys."""
    scores = torch.einsum("ehd,shd->hes", q, k) / math.sqrt(q.shape[-1])
    if causal:
        e, s = q.shape[0], k.shape[0]
        allowed = torch.arange(s)[None, :] <= torch.arange(s - e, s)[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [H, E]
    return torch.einsum("hes,shd->ehd", scores.softmax(-1), v), lse.T


def keys(pages: np.ndarray, last: int, page: int, cache: torch.Tensor) -> torch.Tensor:
    slots = np.concatenate([np.arange(p * page, (p + 1) * page) for p in pages])
    return cache[torch.from_numpy(slots[: len(slots) - page + last])]


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("prefix_len", [640, 651])  # page-aligned or not
def test_segments_and_main_plan_merged_equal_causal_attention(page: int, prefix_len: int) -> None:
    rule = SplitRule(min_prefix=64, min_segment=64, max_segments=4)
    prefix, ext = [prefix_len, 40, 70], [37, 1, 1]
    seq = [p + e for p, e in zip(prefix, ext)]
    indptr, indices, last = table(seq, page, seed=3)
    split = plan_prefix_split(indptr, indices, last, prefix, ext, page, 4, 64, rule)
    assert split is not None and split.rows == [0] and split.segments == 4
    g = torch.Generator().manual_seed(0)
    slots = (int(indices.max()) + 1) * page
    kc, vc = (torch.randn(slots, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(sum(ext), 4, 16, generator=g, dtype=torch.float64)
    starts = np.concatenate([[0], np.cumsum(ext)])
    want = [attend(q[starts[r]: starts[r + 1]], keys(indices[indptr[r]: indptr[r + 1]], last[r], page, kc),
                   keys(indices[indptr[r]: indptr[r + 1]], last[r], page, vc), True)[0] for r in range(3)]
    mi, mx, ml = split.main
    got = [attend(q[starts[r]: starts[r + 1]], keys(mx[mi[r]: mi[r + 1]], ml[r], page, kc),
                  keys(mx[mi[r]: mi[r + 1]], ml[r], page, vc), True) for r in range(3)]
    si, sx, sl = split.prefix
    qi = torch.from_numpy(split.query_index)
    parts = [attend(q[qi], keys(sx[si[s]: si[s + 1]], sl[s], page, kc), keys(sx[si[s]: si[s + 1]], sl[s], page, vc),
                    False) for s in range(split.segments)] + [got[0]]
    lse = torch.stack([p[1] for p in parts])  # [S+1, E, H]
    weights = torch.softmax(lse, 0)[..., None]
    merged = (weights * torch.stack([p[0] for p in parts])).sum(0)
    torch.testing.assert_close(merged, want[0], rtol=1e-10, atol=1e-10)
    for r in (1, 2):
        torch.testing.assert_close(got[r][0], want[r], rtol=1e-10, atol=1e-10)
