"""Sampler tests, each against a plain reference written here (or transformers' own processor)."""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from modeserve.engine.runner.sampler import SamplingTensors, apply_penalties, compute_logprobs, sample
from modeserve.kernels import sampling
from modeserve.kernels.sampling import gumbel_noise


def fused_sample_sorted(*args: Tensor) -> Tensor:
    """The Triton kernel of the step after the sort (in Triton's CPU interpreter without a GPU)."""
    from modeserve.kernels.triton.sampling import sample_sorted

    return sample_sorted(*args)


# the step after the sort: the torch reference, and the fused Triton kernel of the same signature
SAMPLE_SORTED = pytest.mark.parametrize("impl", [sampling.sample_sorted, fused_sample_sorted], ids=["torch", "triton"])


def make_st(batch: int, device: str = "cpu", **rows: Any) -> SamplingTensors:
    """SamplingTensors with neutral defaults; keyword lists/tensors override per-row fields."""
    defaults: dict[str, tuple[Any, torch.dtype]] = {
        "temperatures": (1.0, torch.float32),
        "top_ps": (1.0, torch.float32),
        "top_ks": (-1, torch.int64),
        "min_ps": (0.0, torch.float32),
        "seeds": (1234, torch.int64),
        "positions": (0, torch.int64),
        "frequency_penalties": (0.0, torch.float32),
        "presence_penalties": (0.0, torch.float32),
        "repetition_penalties": (1.0, torch.float32),
    }
    fields: dict[str, Any] = {}
    for name, (default, dtype) in defaults.items():
        value = rows.pop(name, default)
        if isinstance(value, (int, float)):
            fields[name] = torch.full((batch,), value, dtype=dtype, device=device)
        else:
            fields[name] = torch.as_tensor(value, dtype=dtype, device=device)
    fields["any_penalties"] = rows.pop("any_penalties", False)
    fields["all_greedy"] = rows.pop("all_greedy", False)
    fields["max_top_n"] = rows.pop("max_top_n", 0)
    assert not rows, rows
    return SamplingTensors(**fields)


# ------------------------------------------------------------------------------------------------
# Greedy
# ------------------------------------------------------------------------------------------------


@SAMPLE_SORTED
def test_greedy_rows_equal_argmax_in_mixed_batch(impl: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    temps = [0.0, 1.0, 0.0, 0.5, 0.0, 2.0]
    st = make_st(6, temperatures=temps, top_ks=[3] * 6, top_ps=[0.5] * 6, min_ps=[0.2] * 6)
    out = sample(logits, st, impl)
    for b, t in enumerate(temps):
        if t == 0.0:
            assert out[b].item() == max(range(50), key=lambda i: logits[b, i].item())
    assert out.dtype == torch.int64 and out.shape == (6,)


def test_all_greedy_fast_path_equals_general_path() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 200, generator=gen)
    slow = sample(logits, make_st(16, temperatures=0.0, top_ks=5, top_ps=0.3, min_ps=0.5, all_greedy=False))
    fast = sample(logits, make_st(16, temperatures=0.0, all_greedy=True))
    assert torch.equal(slow, fast)
    assert torch.equal(fast, torch.tensor([max(range(200), key=lambda i: row[i].item()) for row in logits]))


# ------------------------------------------------------------------------------------------------
# Filters and distribution
# ------------------------------------------------------------------------------------------------

BASE_LOGITS = [2.0, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -0.8, -1.5, -2.0, -3.0]
PEAKED_LOGITS = [3.0, 2.5, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0, -0.1, -0.2, -0.3, -0.4]


def ref_distribution(logits: list[float], temp: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Hugging Face order: temperature, top-k, top-p over the top-k renormalised set, min-p; renormalise."""
    scaled = [x / temp for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i] for i in kept)
    kept_p: list[int] = []
    acc = 0.0
    for i in kept:
        kept_p.append(i)
        acc += probs[i] / mass
        if acc >= top_p:
            break
    final = [i for i in kept_p if probs[i] >= min_p * probs[order[0]]]
    total = sum(probs[i] for i in final)
    return [probs[i] / total if i in final else 0.0 for i in range(len(probs))]


FILTER_CASES = {
    # name: (logits, temperature, top_k, top_p, min_p)
    "no_filter": (BASE_LOGITS, 1.0, -1, 1.0, 0.0),
    "top_k": (BASE_LOGITS, 0.8, 5, 1.0, 0.0),
    "top_p": (BASE_LOGITS, 1.6, 0, 0.7, 0.0),
    "min_p": (BASE_LOGITS, 1.0, -1, 1.0, 0.15),
    "combined": (BASE_LOGITS, 0.7, 8, 0.85, 0.1),
    # top-p must act on the top-k renormalised mass: over the full distribution it would keep rank 2.
    "top_p_after_top_k": (PEAKED_LOGITS, 1.0, 3, 0.93, 0.0),
    "hot": (BASE_LOGITS, 2.5, 10, 0.9, 0.0),
}
N_DRAWS = 20_000
MAX_ABS_BOUND = 0.012  # ~3.4 sigma of a single frequency at p = 0.5 with 20k draws


@functools.lru_cache(maxsize=None)
def draw(case: str) -> tuple[list[float], Counter[int]]:
    logits, temp, top_k, top_p, min_p = FILTER_CASES[case]
    gen = torch.Generator().manual_seed(list(FILTER_CASES).index(case))
    seeds = torch.randint(-(2**63), 2**63 - 1, (N_DRAWS,), generator=gen, dtype=torch.int64)
    st = make_st(
        N_DRAWS,
        temperatures=temp,
        top_ks=top_k,
        top_ps=top_p,
        min_ps=min_p,
        seeds=seeds,
        positions=torch.randint(0, 1 << 20, (N_DRAWS,), generator=gen),
    )
    out = sample(torch.tensor([logits] * N_DRAWS), st)
    expected = ref_distribution(logits, temp, top_k, top_p, min_p)
    return expected, Counter(out.tolist())


@pytest.mark.parametrize("case", list(FILTER_CASES))
def test_support_equals_reference_filtered_set(case: str) -> None:
    expected, counts = draw(case)
    kept = {i for i, p in enumerate(expected) if p > 0}
    assert set(counts) == kept


@pytest.mark.parametrize("case", list(FILTER_CASES))
def test_distribution_matches_renormalised_filtered(case: str) -> None:
    logits, temp, top_k, top_p, min_p = FILTER_CASES[case]
    expected, counts = draw(case)
    empirical = [counts.get(i, 0) / N_DRAWS for i in range(len(logits))]
    assert max(abs(e - q) for e, q in zip(empirical, expected)) < MAX_ABS_BOUND

    kept = [i for i, p in enumerate(expected) if p > 0]
    chi2 = sum((counts.get(i, 0) - N_DRAWS * expected[i]) ** 2 / (N_DRAWS * expected[i]) for i in kept)
    dof = len(kept) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 6

    # The bound is meaningful: plausible wrong samplers are far outside it.
    wrong: list[list[float]] = [[1 / len(kept) if i in kept else 0.0 for i in range(len(logits))]]
    if temp != 1.0:
        wrong.append(ref_distribution(logits, 1.0, top_k, top_p, min_p))  # temperature ignored
    if len(kept) < len(logits):
        wrong.append(ref_distribution(logits, temp, -1, 1.0, 0.0))  # filters ignored
    if case == "top_p_after_top_k":
        wrong.append(ref_distribution(logits, temp, 3, 1.0, 0.0))  # top-p on the un-renormalised mass
    for alt in wrong:
        assert max(abs(a - q) for a, q in zip(alt, expected)) > 3 * MAX_ABS_BOUND


@SAMPLE_SORTED
def test_masked_tokens_never_chosen_even_when_nearly_tied(impl: Any) -> None:
    rows = 64  # unmasked, tokens 1 and 2 would win about 2 draws in 3 (all 64 on 0 by chance: ~3^-64)
    logits = torch.tensor([[5.0, 4.999, 4.998] + [-1.0] * 13] * rows)
    st = make_st(rows, top_ks=1, seeds=torch.arange(rows), positions=torch.arange(rows))
    assert torch.all(sample(logits, st, impl) == 0)
    st = make_st(rows, top_ks=2, seeds=torch.arange(rows), positions=torch.arange(rows))
    assert set(sample(logits, st, impl).tolist()) == {0, 1}


# ------------------------------------------------------------------------------------------------
# Seeds
# ------------------------------------------------------------------------------------------------


@SAMPLE_SORTED
def test_seeded_rows_independent_of_batch_composition_and_order(impl: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 64
    logits = torch.randn(8, vocab, generator=gen)
    seeds = torch.tensor([7, -7, 2**62, -(2**63), 0, 1, 123456789, 2**40 + 5])
    positions = torch.tensor([0, 5, 100, 7, 3, 3, 4096, 1])
    temps = [1.0, 0.7, 1.3, 1.0, 1.0, 2.0, 0.9, 1.0]
    top_ks = [-1, 20, 0, 10, -1, 40, -1, 5]
    base = sample(logits, make_st(8, temperatures=temps, top_ks=top_ks, seeds=seeds, positions=positions), impl)

    others = torch.randn(5, vocab, generator=gen)
    perm = torch.tensor([11, 3, 0, 12, 7, 9, 1, 5, 8, 2, 10, 6, 4])
    big_logits = torch.cat([logits, others])[perm]
    big = make_st(
        13,
        temperatures=torch.tensor(temps + [0.0, 1.0, 0.5, 3.0, 1.0])[perm],
        top_ks=torch.tensor(top_ks + [-1, 2, 3, -1, 7])[perm],
        top_ps=torch.tensor([1.0] * 8 + [0.5, 0.9, 0.2, 1.0, 0.7])[perm],
        seeds=torch.cat([seeds, torch.tensor([7, 7, 99, -1, 5])])[perm],
        positions=torch.cat([positions, torch.tensor([0, 5, 100, 7, 3])])[perm],
    )
    mixed = sample(big_logits, big, impl)
    for row in range(13):
        if perm[row] < 8:
            assert mixed[row] == base[perm[row]]
    # And again, as after preemption and recomputation.
    again = sample(logits.clone(), make_st(8, temperatures=temps, top_ks=top_ks, seeds=seeds, positions=positions),
                   impl)
    assert torch.equal(again, base)


def sequence(seed: int, steps: int = 48, vocab: int = 16) -> list[int]:
    st = make_st(steps, seeds=seed, positions=torch.arange(steps))
    return sample(torch.zeros(steps, vocab), st).tolist()


def test_different_seeds_give_different_sequences() -> None:
    seeds = [0, 1, 2, -1, 2**32, 2**32 + 1, -(2**63), 2**63 - 1]
    seqs = [sequence(s) for s in seeds]
    for i in range(len(seqs)):
        for j in range(i + 1, len(seqs)):
            agree = sum(a == b for a, b in zip(seqs[i], seqs[j]))
            assert agree < 12, (seeds[i], seeds[j], agree)  # chance agreement is 1/16 per step
    assert sequence(5) == sequence(5)


def test_gumbel_noise_is_a_function_of_vocab_id_not_column() -> None:
    seeds = torch.tensor([3, -9])
    positions = torch.tensor([10, 11])
    ids = torch.stack([torch.arange(32), torch.arange(32).flip(0)])  # [2, 32]
    noise = gumbel_noise(seeds, positions, ids)
    straight = gumbel_noise(seeds, positions, torch.arange(32).expand(2, 32))
    assert torch.equal(noise[0], straight[0])
    assert torch.equal(noise[1], straight[1].flip(0))
    assert torch.isfinite(noise).all()


# ------------------------------------------------------------------------------------------------
# Penalties
# ------------------------------------------------------------------------------------------------


def penalty_inputs(pad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(4)
    vocab, length = 20, 12
    logits = torch.randn(4, vocab, generator=gen) * 3
    token_ids = torch.randint(0, vocab, (4, length), generator=gen)
    prompt_lens = torch.tensor([3, 5, 1, 4])
    seq_lens = torch.tensor([7, 5, 12, 6])  # row 1 has generated nothing yet, row 2 has no padding
    cols = torch.arange(length)
    token_ids = torch.where(cols[None, :] < seq_lens[:, None], token_ids, pad)
    return logits, token_ids, prompt_lens, seq_lens


def ref_penalties(logits: Tensor, ids: Tensor, prompt_lens: Tensor, seq_lens: Tensor,
                  rep: list[float], freq: list[float], pres: list[float]) -> Tensor:
    rows = []
    for b in range(logits.shape[0]):
        history = ids[b, : seq_lens[b]]
        row = RepetitionPenaltyLogitsProcessor(rep[b])(history[None, :], logits[b : b + 1].clone())[0]
        generated = Counter(ids[b, prompt_lens[b] : seq_lens[b]].tolist())
        for tok in range(logits.shape[1]):
            count = generated.get(tok, 0)
            row[tok] -= freq[b] * count + pres[b] * (1.0 if count > 0 else 0.0)
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("pad_kind", ["valid_ids", "garbage"])
def test_penalties_match_reference_and_ignore_padding(pad_kind: str) -> None:
    pad = torch.full((4, 12), 2) if pad_kind == "valid_ids" else torch.randint(-5, 40, (4, 12))
    logits, ids, prompt_lens, seq_lens = penalty_inputs(pad)
    rep, freq, pres = [1.3, 0.8, 1.0, 2.0], [0.5, -0.4, 1.5, 0.0], [0.7, 0.2, -1.0, 0.0]
    st = make_st(4, repetition_penalties=rep, frequency_penalties=freq, presence_penalties=pres, any_penalties=True)
    got = apply_penalties(logits, ids, prompt_lens, seq_lens, st)
    clean_ids = torch.where(torch.arange(12)[None, :] < seq_lens[:, None], ids, 0)
    expected = ref_penalties(logits, clean_ids, prompt_lens, seq_lens, rep, freq, pres)
    torch.testing.assert_close(got, expected)
    assert not torch.equal(got, logits)


def test_penalties_skipped_when_flag_false() -> None:
    logits, ids, prompt_lens, seq_lens = penalty_inputs(torch.zeros(4, 12, dtype=torch.int64))
    st = make_st(4, repetition_penalties=2.0, any_penalties=False)
    assert apply_penalties(logits, ids, prompt_lens, seq_lens, st) is logits


def test_neutral_penalties_are_identity() -> None:
    logits, ids, prompt_lens, seq_lens = penalty_inputs(torch.zeros(4, 12, dtype=torch.int64))
    st = make_st(4, any_penalties=True)
    torch.testing.assert_close(apply_penalties(logits, ids, prompt_lens, seq_lens, st), logits)


# ------------------------------------------------------------------------------------------------
# Logprobs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax_and_true_top_n(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(5, 30, generator=gen) * 4).to(dtype)
    next_ids = torch.tensor([0, 29, 7, 7, 13])
    res = compute_logprobs(logits, next_ids, 4)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert res.chosen.dtype == torch.float32 and res.top_values.dtype == torch.float32
    assert res.top_ids.dtype == torch.int64 and res.top_ids.shape == (5, 4)
    torch.testing.assert_close(res.chosen.double(), ref[torch.arange(5), next_ids], rtol=1e-5, atol=1e-5)
    for b in range(5):
        true_top = sorted(range(30), key=lambda i: -ref[b, i].item())[:4]
        assert res.top_ids[b].tolist() == true_top
        torch.testing.assert_close(res.top_values[b].double(), ref[b, true_top], rtol=1e-5, atol=1e-5)


def test_logprobs_top_zero() -> None:
    res = compute_logprobs(torch.randn(3, 10), torch.tensor([1, 2, 3]), 0)
    assert res.top_ids.shape == (3, 0) and res.top_values.shape == (3, 0) and res.chosen.shape == (3,)


# ------------------------------------------------------------------------------------------------
# CUDA: same tokens as on CPU, and no host synchronisation inside the sampler
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@SAMPLE_SORTED
def test_cuda_sync_free_and_matches_cpu(impl: Any) -> None:
    gen = torch.Generator().manual_seed(6)
    batch, vocab = 64, 1000
    logits = torch.randn(batch, vocab, generator=gen) * 2
    ids = torch.randint(0, vocab, (batch, 40), generator=gen)
    prompt_lens, seq_lens = torch.full((batch,), 10), torch.randint(10, 40, (batch,), generator=gen)
    kw: dict[str, Any] = dict(
        temperatures=torch.rand(batch, generator=gen) * 1.5,
        top_ks=torch.randint(-1, 50, (batch,), generator=gen),
        top_ps=torch.rand(batch, generator=gen) * 0.9 + 0.1,
        min_ps=torch.rand(batch, generator=gen) * 0.1,
        seeds=torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen),
        positions=seq_lens,
        repetition_penalties=1.2,
        frequency_penalties=0.3,
        presence_penalties=0.2,
        any_penalties=True,
    )
    cpu_st = make_st(batch, **kw)
    cpu = sample(apply_penalties(logits, ids, prompt_lens, seq_lens, cpu_st), cpu_st)

    cuda_st = make_st(batch, device="cuda", **{k: v.cuda() if isinstance(v, Tensor) else v for k, v in kw.items()})
    args = (logits.cuda(), ids.cuda(), prompt_lens.cuda(), seq_lens.cuda())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        penalised = apply_penalties(*args, cuda_st)
        out = sample(penalised, cuda_st, impl)
        compute_logprobs(args[0], out, 5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    agree = (out.cpu() == cpu).float().mean().item()
    assert agree > 0.95  # float rounding may flip a rare near-tie between devices
