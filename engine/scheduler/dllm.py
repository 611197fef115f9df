"""Block diffusion (DLLM_EXTEND) on the scheduler's side: a request's current block and the
LowConfidence rule that unmasks it.

Conventions (SDAR's generation code): blocks lie at multiples of the block size from position 0; the
prompt's whole blocks are prefilled block-causally (each block sees itself and the blocks before it)
and its last partial block, filled up with masks, is the first block denoised; the logits at a
position choose that position's token (no shift); a block with no mask left is committed, and its
keys and values are written by the next step's forward over its final tokens (with the next block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Block:
    start: int  # position of the block's first token
    tokens: np.ndarray  # [block size] int64: the mask id where still masked (prompt tokens are never masked)
    steps: int = 0  # DLLM_EXTEND steps run on it


def new_block(fill: list[int], block_size: int, mask_token_id: int) -> Block:
    """The block after ``fill`` (prompt and committed tokens): their last partial block filled up with masks,
    or a block of masks."""
    start = len(fill) // block_size * block_size
    tokens = np.full(block_size, mask_token_id, dtype=np.int64)
    tokens[: len(fill) - start] = fill[start:]
    return Block(start, tokens)


def low_confidence(block: Block, mask_token_id: int, chosen: np.ndarray, confidence: np.ndarray,
                   threshold: float, max_steps: int) -> None:
    """One step's unmasking, in place: each masked position whose chosen token has probability >= ``threshold``,
    and at least the ceil(masked / steps left) most confident (the lowest position first among equals), so that
    the block is done in ``max_steps`` steps."""
    masked = np.flatnonzero(block.tokens == mask_token_id)
    conf = confidence[masked]
    need = -(-len(masked) // max(max_steps - block.steps, 1))
    take = conf >= threshold
    if int(take.sum()) < need:
        take = np.zeros(len(masked), dtype=bool)
        take[np.argsort(-conf, kind="stable")[:need]] = True
    block.tokens[masked[take]] = chosen[masked[take]]
    block.steps += 1


def is_done(block: Block, mask_token_id: int) -> bool:
    return not bool((block.tokens == mask_token_id).any())
