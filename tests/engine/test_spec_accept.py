"""TARGET_VERIFY's accept/reject decision against references written here: greedy against a loop;
n-gram (one-hot) drafts token for token against the non-speculative sampler; draft-model drafts by
the distribution of the output (chi-square, alpha = 0.01), which an accept-everything rule fails; a
seeded row's output whatever else is in the batch."""

from __future__ import annotations

import torch
from torch import Tensor

from modeserve.engine.runner.sampler import SamplingTensors, sample
from modeserve.engine.runner.spec_accept import accept_greedy, accept_sampled

CHI2_CRITICAL_DF3 = 11.345  # chi-square, 3 degrees of freedom, alpha = 0.01


def test_greedy_against_a_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    b, k, v = 64, 5, 11
    logits = torch.randn(b, k + 1, v, generator=gen)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :k].clone()
    cut = torch.randint(0, k + 1, (b,), generator=gen)  # the first wrong draft (k: all right)
    for row in range(b):
        if cut[row] < k:
            drafts[row, cut[row]] = (argmax[row, cut[row]] + 1) % v
    accepted, tokens = accept_greedy(drafts, logits)
    for row in range(b):
        n = 0
        while n < k and drafts[row, n] == argmax[row, n]:
            n += 1
        assert accepted[row] == n == cut[row]
        assert tokens[row, :n + 1].tolist() == drafts[row, :n].tolist() + [int(argmax[row, n])]


def sampling_tensors(seeds: Tensor, positions: Tensor) -> SamplingTensors:
    n = seeds.shape[0]
    ones, zeros = torch.ones(n), torch.zeros(n)
    return SamplingTensors(temperatures=ones, top_ps=ones, top_ks=torch.full((n,), -1), min_ps=zeros, seeds=seeds,
                           positions=positions, frequency_penalties=zeros, presence_penalties=zeros,
                           repetition_penalties=ones, any_penalties=False, all_greedy=False, max_top_n=0)


def test_one_hot_drafts_give_the_non_speculative_samplers_tokens() -> None:
    """With q one-hot, keeping d exactly when the target's own seeded draw is d: every emitted token
    is the one the non-speculative sampler draws at that position with that seed."""
    gen = torch.Generator().manual_seed(1)
    b, k, v = 256, 4, 7
    logits = torch.randn(b, k + 1, v, generator=gen) * 2
    seeds = torch.randint(0, 2**62, (b,), generator=gen)
    positions = torch.randint(10, 500, (b, 1), generator=gen) + torch.arange(k + 1)
    plain = torch.stack([sample(logits[:, t], sampling_tensors(seeds, positions[:, t])) for t in range(k + 1)], 1)
    drafts = plain[:, :k].clone()
    wrong = torch.rand(b, k, generator=gen) < 0.3  # some drafts differ from what the target draws
    drafts[wrong] = (drafts[wrong] + 1) % v
    accepted, tokens = accept_sampled(drafts, None, logits.softmax(-1), seeds, positions)
    expect = (~wrong).to(torch.int64).cumprod(1).sum(1)
    assert torch.equal(accepted, expect) and 0 < float(accepted.float().mean()) < k
    for row in range(b):
        n = int(accepted[row])
        assert tokens[row, :n + 1].tolist() == plain[row, :n + 1].tolist()


def chi_square(samples: Tensor, probs: Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.shape[0]).to(torch.float64)
    expected = probs.to(torch.float64) * samples.shape[0]
    return float(((counts - expected) ** 2 / expected).sum())


def draft_setup(n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """n seeded rows of k = 2 drafts drawn from q, over a 4-token vocabulary where the target's
    distribution p differs from q at every position."""
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.4, 0.1]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.4, 0.4]])
    drafts = torch.stack([torch.multinomial(q[t], n, replacement=True, generator=gen) for t in range(2)], 1)
    seeds = torch.randint(0, 2**62, (n,), generator=gen)
    positions = torch.arange(3).expand(n, 3) + 7
    return drafts, q.expand(n, 2, 4), p.expand(n, 3, 4), seeds, positions


def test_draft_model_output_is_distributed_as_the_target() -> None:
    """Position-only target distributions: the first emitted token is distributed as p[0], and
    the second (when the first draft was kept) as p[1]; an accept-everything rule fails the test."""
    n = 40000
    drafts, q, p, seeds, positions = draft_setup(n)
    accepted, tokens = accept_sampled(drafts, q, p, seeds, positions)
    assert chi_square(tokens[:, 0], p[0, 0]) < CHI2_CRITICAL_DF3
    second = tokens[accepted >= 1, 1]
    assert second.shape[0] > n // 4 and chi_square(second, p[0, 1]) < CHI2_CRITICAL_DF3
    # accepted-draft rate at position 0 is sum(min(p, q)) = 0.6
    assert abs(float((accepted >= 1).double().mean()) - 0.6) < 0.01
    accept_all = drafts[:, 0]  # a wrong rule: every draft kept, so the first token is q's
    assert chi_square(accept_all, p[0, 0]) > CHI2_CRITICAL_DF3


def test_a_seeded_row_is_the_same_in_any_batch() -> None:
    drafts, q, p, seeds, positions = draft_setup(64)
    accepted, tokens = accept_sampled(drafts, q, p, seeds, positions)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:16]
    sub_accepted, sub_tokens = accept_sampled(drafts[order], q[order], p[order], seeds[order], positions[order])
    assert torch.equal(sub_accepted, accepted[order])
    for i, row in enumerate(order.tolist()):
        n = int(accepted[row])
        assert torch.equal(sub_tokens[i, :n + 1], tokens[row, :n + 1])
