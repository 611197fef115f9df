"""The forward-mode enum, its traits table and the mode decision."""

from __future__ import annotations

import pytest

from modeserve.engine.forward_mode import MODE_TRAITS, ForwardMode, determine_forward_mode


def test_numbers_follow_sglang() -> None:
    assert [(m.name, int(m)) for m in ForwardMode] == [
        ("EXTEND", 1), ("DECODE", 2), ("MIXED", 3), ("IDLE", 4), ("TARGET_VERIFY", 5), ("DRAFT_EXTEND", 6),
        ("DLLM_EXTEND", 7), ("SPLIT_PREFILL", 8),
    ]


def test_traits_table_covers_every_mode() -> None:
    assert set(MODE_TRAITS) == set(ForwardMode)
    assert [m.name for m in ForwardMode if m.traits.supported] == ["EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY",
                                                                      "DLLM_EXTEND", "SPLIT_PREFILL"]
    assert not ForwardMode.DRAFT_EXTEND.traits.supported  # the draft model's sub-step, never a batch's mode
    assert ForwardMode.DECODE.traits.uses_cuda_graph and not ForwardMode.MIXED.traits.uses_cuda_graph
    assert ForwardMode.EXTEND.traits.is_extend and ForwardMode.MIXED.traits.is_extend
    assert not ForwardMode.IDLE.traits.samples


@pytest.mark.parametrize(
    "num_extend, num_decode, mode",
    [(2, 0, ForwardMode.EXTEND), (0, 3, ForwardMode.DECODE), (1, 4, ForwardMode.MIXED), (0, 0, ForwardMode.IDLE)],
)
def test_determine_forward_mode(num_extend: int, num_decode: int, mode: ForwardMode) -> None:
    assert determine_forward_mode(num_extend, num_decode) == mode


def test_unsupported_mode_message_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="DRAFT_EXTEND is not implemented.*EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY"):
        ForwardMode.DRAFT_EXTEND.require_supported()
    ForwardMode.MIXED.require_supported()
