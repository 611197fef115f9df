"""``bench attention``'s names for the Triton kernel's variants: the split count and launch shape it
reads from ``triton@SPLITS:BLOCK_N:WARPS:STAGES``, and the bad names it refuses."""

from __future__ import annotations

import pytest
import torch

from modeserve.kernels.attention.kv_cache import KVCache
from modeserve.kernels.triton.attention_decode import DecodeTiles
from modeserve.service.bench.attention import make_backend, parse_triton_variant


@pytest.mark.parametrize(("name", "splits", "tiles"), [
    ("triton", None, None),
    ("triton@12", 12, None),
    ("triton@1:64:8:2", 1, DecodeTiles(64, 8, 2)),
    ("triton@:128", None, DecodeTiles(128, None, None)),
    ("triton@::8", None, DecodeTiles(32, 8, None)),  # an empty part keeps its default
    ("triton@4:::3", 4, DecodeTiles(32, None, 3)),
])
def test_triton_variant_names(name: str, splits: int | None, tiles: DecodeTiles | None) -> None:
    assert parse_triton_variant(name) == (splits, tiles)


@pytest.mark.parametrize(("name", "match"), [
    ("triton@x", "integers"), ("triton@1:64:8:2:9", "integers"), ("triton@-1", "integers"),
    ("triton@0", "at least 1"), ("triton@:24", "block_n"), ("triton@:32:3", "num_warps"),
    ("triton@:32:4:0", "num_stages"),
])
def test_bad_triton_variant_names(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_triton_variant(name)


def test_unknown_backend_is_refused() -> None:
    kv = KVCache(1, 16, 2, 16, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown backend 'flash'"):
        make_backend("flash", kv, 4)
