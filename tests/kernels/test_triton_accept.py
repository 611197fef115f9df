"""A verify step's greedy acceptance (``accept_runs``) as one Triton kernel equals the torch reference, and
both equal a plain loop over the runs: a draft is kept while it and every draft before it equal the
target's token before them; the token after the kept drafts lands in ``last_token`` at the request's slot,
the start of a chained next step (its first position + kept + 2) in ``fill_len``; other slots keep theirs.
Without a GPU the kernel runs in Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

from modeserve.kernels import accept


def make_step(lens: list[int], device: str, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(step: sampled, input_ids, positions, starts, lens, slots; tables: last_token, fill_len). The drafts
    agree with the target's tokens for a random number of leading drafts of each run, then differ."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    sampled = torch.randint(3, 50, (t,), generator=g)
    ids = torch.randint(50, 100, (t,), generator=g)  # never equal to a sampled token ...
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    for s, n in zip(starts.tolist(), lens):
        agree = int(torch.randint(0, n, (1,), generator=g))  # ... except the first ``agree`` drafts
        ids[s + 1 : s + 1 + agree] = sampled[s : s + agree]
    positions = torch.cat([torch.arange(n) + int(torch.randint(0, 200, (1,), generator=g)) for n in lens])
    table = 2 * len(lens) + 4  # slots no request of the step holds keep their values
    slots = torch.randperm(table, generator=g)[: len(lens)]
    tables = [torch.full((table,), -7, dtype=torch.int64), torch.full((table,), -9, dtype=torch.int64)]
    step = [sampled, ids, positions, starts, torch.tensor(lens), slots]
    return [x.to(device) for x in step], [x.to(device) for x in tables]


def loop_reference(step: list[torch.Tensor], tables: list[torch.Tensor]) -> list[torch.Tensor]:
    sampled, ids, positions, starts, lens, slots = (x.tolist() for x in step)
    last, fill = (x.clone().cpu() for x in tables)
    kept_all = []
    for s, n, slot in zip(starts, lens, slots):
        kept = 0
        while kept < n - 1 and ids[s + 1 + kept] == sampled[s + kept]:
            kept += 1
        kept_all.append(kept)
        last[slot], fill[slot] = sampled[s + kept], positions[s] + kept + 2
    return [torch.tensor(kept_all, dtype=torch.int64), last, fill]


def _impls() -> list:  # noqa: ANN401
    from modeserve.kernels.triton.accept import accept_runs

    return [accept_runs, accept.accept_runs]


@pytest.mark.parametrize("lens", [[5], [1], [5, 1, 3, 9, 5], [2] * 40])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_accept_runs_equals_a_loop(lens: list[int], impl: str) -> None:
    fn = _impls()[0] if impl == "triton" else accept.accept_runs
    for seed in range(3):
        step, tables = make_step(lens, "cpu", seed)
        want = loop_reference(step, tables)
        kept = fn(*step, *tables, max(lens))
        for got, expected in zip([kept, *tables], want):
            assert torch.equal(got, expected), (impl, lens, seed)


def test_every_draft_kept_and_none() -> None:
    """A run whose drafts all agree keeps them all (the target's bonus token after them); one whose first
    draft differs keeps none (the target's correction)."""
    from modeserve.kernels.triton.accept import accept_runs

    sampled = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    ids = torch.tensor([9, 10, 11, 12, 19, 99, 21])
    step = [sampled, ids, torch.arange(7) + 30, torch.tensor([0, 4]), torch.tensor([4, 3]), torch.tensor([1, 0])]
    tables = [torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)]
    assert accept_runs(*step, *tables, 4).tolist() == [3, 0]
    assert tables[0].tolist() == [20, 13] and tables[1].tolist() == [34 + 0 + 2, 30 + 3 + 2]


def test_accept_runs_refusals() -> None:
    from modeserve.kernels.triton.accept import accept_runs

    step, tables = make_step([3, 2], "cpu")
    with pytest.raises(ValueError, match="int64"):
        accept_runs(step[0].to(torch.int32), *step[1:], *tables, 3)
    with pytest.raises(ValueError, match="a request each"):
        accept_runs(*step[:5], step[5][:1], *tables, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[5], [5, 1, 3, 9, 5], [9] * 64])
def test_accept_runs_gpu(lens: list[int]) -> None:
    from modeserve.kernels.triton.accept import accept_runs

    step, tables = make_step(lens, "cuda", seed=len(lens))
    want = loop_reference(step, tables)
    kept = accept_runs(*step, *tables, max(lens))
    for got, expected in zip([kept, *tables], want):
        assert torch.equal(got.cpu(), expected)
