"""The two-pass Triton argmax equals ``torch.argmax`` (the first maximum of each row): random rows,
ties inside one chunk and across chunks, rows of -inf, vocabularies that are not a multiple of the
chunk, 16-bit inputs. Without a GPU it runs in Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch
from modeserve.kernels import ops
from modeserve.kernels.triton.argmax import CHUNK, argmax


def rows_with_ties(rows: int, vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=g)
    top = x.max() + 1
    if rows > 1:  # row 1: the same maximum twice in one chunk, then again in a later chunk
        x[1, [5, 9, min(vocab - 1, CHUNK + 3)]] = top
    if rows > 2:  # row 2: the maximum only in the last, partial chunk
        x[2, vocab - 1] = top
    if rows > 3:  # row 3: nothing but -inf (torch answers 0)
        x[3] = float("-inf")
    if rows > 4:  # row 4: ties at the start of two chunks (or the row's last two columns)
        x[4, [min(CHUNK, vocab - 2), min(2 * CHUNK, vocab - 1)]] = top
    return x.to(device, dtype)


def check(rows: int, vocab: int, dtype: torch.dtype, device: str) -> None:
    x = rows_with_ties(rows, vocab, dtype, device)
    out = argmax(x)
    assert out.dtype == torch.int64 and out.shape == (rows,)
    assert torch.equal(out, ops.argmax(x))


@pytest.mark.parametrize("rows,vocab", [(1, 100), (5, 3 * CHUNK + 17), (6, 32000), (2, CHUNK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_argmax_equals_torch(rows: int, vocab: int, dtype: torch.dtype) -> None:
    check(rows, vocab, dtype, "cpu")


def test_argmax_of_a_slice_and_refusals() -> None:
    x = rows_with_ties(6, 3000, torch.float32, "cpu")
    assert torch.equal(argmax(x[2:5]), torch.argmax(x[2:5], dim=-1))  # row stride of the parent
    assert argmax(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="contiguous last dim"):
        argmax(x.t())
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        argmax(x[0])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (5, 151936), (256, 128256), (7, 3 * CHUNK + 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_argmax_equals_torch_gpu(rows: int, vocab: int, dtype: torch.dtype) -> None:
    check(rows, vocab, dtype, "cuda")


@pytest.mark.parametrize("impl", [argmax, ops.argmax], ids=["triton", "torch"])
def test_argmax_writes_into_slots(impl) -> None:  # noqa: ANN001
    """``into[at] = result`` in the same call (the engine's last token of each slot); other slots untouched."""
    x = rows_with_ties(5, 3 * CHUNK + 17, torch.float32, "cpu")
    last = torch.full((9,), -7, dtype=torch.int64)
    at = torch.tensor([8, 0, 3, 5, 1])
    out = impl(x, last, at)
    assert torch.equal(out, torch.argmax(x, dim=-1))
    expected = torch.full((9,), -7, dtype=torch.int64)
    for row, slot in enumerate(at.tolist()):
        expected[slot] = torch.argmax(x[row]).item()
    assert torch.equal(last, expected)


def test_argmax_refuses_bad_scatter_targets() -> None:
    x = rows_with_ties(2, 300, torch.float32, "cpu")
    for into, at in ((torch.zeros(4, dtype=torch.int32), torch.tensor([0, 1])),
                     (torch.zeros(4, dtype=torch.int64), torch.tensor([0])), (torch.zeros(4, dtype=torch.int64), None)):
        with pytest.raises(ValueError, match="into/at"):
            argmax(x, into, at)
