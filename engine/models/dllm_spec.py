"""The block of a block-diffusion model (SDAR): its size and mask token, from the checkpoint or the
engine arguments, checked once at start."""

from __future__ import annotations

from typing import NamedTuple

from .model_config import ModelConfig


class DllmSpec(NamedTuple):
    block_size: int  # tokens a DLLM_EXTEND step denoises a request; blocks sit at multiples of it from position 0
    mask_token_id: int  # the id a masked position holds


def resolve_dllm(model: ModelConfig, block_size: int | None, mask_token_id: int | None) -> DllmSpec | None:
    """The model's block (engine arguments over ``config.json``); None for an autoregressive model.
    ``ValueError`` for dllm arguments given to an autoregressive model, or a block the model cannot have."""
    if not model.is_dllm:
        if block_size is not None or mask_token_id is not None:
            raise ValueError(f"dllm_block_size / dllm_mask_token_id are for block-diffusion models; "
                             f"{model.architecture} is autoregressive")
        return None
    size = block_size if block_size is not None else model.dllm_block_size
    mask = mask_token_id if mask_token_id is not None else model.dllm_mask_token_id
    if size is None or mask is None:
        raise ValueError(f"{model.architecture}: config.json has no {'block_size' if size is None else 'mask_token_id'}; "
                         "pass dllm_block_size and dllm_mask_token_id")
    if not 0 <= mask < model.vocab_size:
        raise ValueError(f"dllm_mask_token_id {mask} is outside the vocabulary [0, {model.vocab_size})")
    if size > model.max_position_embeddings:
        raise ValueError(f"dllm_block_size {size} exceeds max_position_embeddings {model.max_position_embeddings}")
    return DllmSpec(size, mask)
