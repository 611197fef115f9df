"""Forward modes: what kind of step a batch is, and the one traits table the engine dispatches on.

The numbers match SGLang's ``ForwardMode`` (and the wire enum in ``proto/``). Code asks the traits
table (``mode.traits.is_extend``, ``mode.traits.uses_cuda_graph``) instead of comparing modes in
scattered ``if`` statements.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class ModeTraits(NamedTuple):
    is_extend: bool  # the step writes more than one new token per request (prefill-like attention)
    is_decode_like: bool  # one (or a fixed few) query tokens per request over cached KV
    uses_cuda_graph: bool  # replayed from a captured CUDA graph on GPU
    samples: bool  # the step returns sampled tokens
    supported: bool  # implemented by this build
    summary: str


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6
    DLLM_EXTEND = 7
    SPLIT_PREFILL = 8

    @property
    def traits(self) -> ModeTraits:
        return MODE_TRAITS[self]

    def require_supported(self) -> None:
        """Raise ``ValueError`` for a mode whose implementation has not landed."""
        if not self.traits.supported:
            raise ValueError(
                f"forward mode {self.name} is not implemented in this build "
                f"({self.traits.summary}); supported modes: "
                f"{', '.join(m.name for m in ForwardMode if m.traits.supported)}"
            )


MODE_TRAITS: dict[ForwardMode, ModeTraits] = {
    ForwardMode.EXTEND: ModeTraits(True, False, False, True, True, "prefill of new or chunked prompts"),
    ForwardMode.DECODE: ModeTraits(False, True, True, True, True, "one new token per running request"),
    ForwardMode.MIXED: ModeTraits(True, False, False, True, True, "a prefill chunk together with decodes"),
    ForwardMode.IDLE: ModeTraits(False, True, True, False, True, "a lockstep DP rank with no work"),
    # k + 1 queries a request; the runner replays its verify graphs when every request has k drafts
    # (uses_cuda_graph stays False: DP lockstep does not pad verify steps to a shared bucket)
    ForwardMode.TARGET_VERIFY: ModeTraits(False, True, False, True, True, "speculative decoding: verify drafts"),
    # the draft model's sub-step inside the engine (its prefill in EXTEND/MIXED steps, its catch-up in
    # TARGET_VERIFY steps), counted in the statistics; never a batch's own mode, so a batch naming it
    # is refused (the target would run it as a plain extend)
    ForwardMode.DRAFT_EXTEND: ModeTraits(True, False, True, True, False, "speculative decoding: draft catch-up"),
    # a block-diffusion model's every step: prompt blocks and the block being denoised (block-causal
    # attention); the runner replays its graphs when every request brings its current block alone
    # (uses_cuda_graph False, as for TARGET_VERIFY: DP lockstep pads decode buckets only)
    ForwardMode.DLLM_EXTEND: ModeTraits(True, False, False, True, True, "diffusion LM block denoising"),
    # one request's prefill (or prefill chunk), a slice of layers a step, between the decode steps; it
    # samples on its last slice only
    ForwardMode.SPLIT_PREFILL: ModeTraits(True, False, False, True, True, "a prefill run a slice of layers per step"),
}


def determine_forward_mode(num_extend_reqs: int, num_decode_reqs: int) -> ForwardMode:
    """The seed's ``determine_forward_mode``, decided by each request's phase, not its extend length.

    A request is *extending* while any of its prompt (or recomputed) tokens lack KV, even when the
    chunk it contributes this step is a single token; it is *decoding* once it samples every step.
    """
    if num_extend_reqs and num_decode_reqs:
        return ForwardMode.MIXED
    if num_extend_reqs:
        return ForwardMode.EXTEND
    if num_decode_reqs:
        return ForwardMode.DECODE
    return ForwardMode.IDLE
