"""How a model is cut over ``size`` tensor-parallel ranks: each rank's share of the attention heads
and MLP columns (its local ``ModelConfig``) and, per checkpoint tensor, the slice of it that rank
loads. q/k/v and gate/up are split by output rows (column parallel), o and down by input columns
(row parallel: their outputs are summed over the ranks). KV heads are split when there are at least
as many as ranks, else replicated: rank r keeps KV head r * num_kv_heads // size, the one its query
heads read. The LM head is split by vocabulary rows where the ranks divide the vocabulary (each rank
reads 1/size of it a step; the logits are gathered), else whole on every rank. Embedding and norms
are whole on every rank (a step reads only its tokens' rows of the embedding)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..models.model_config import ModelConfig


class Slice(NamedTuple):
    dim: int
    start: int
    length: int


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """``ValueError`` unless ``size`` ranks can share the model's heads and MLP evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} and the model's {kv} KV heads: one must divide the other")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the MLP's {cfg.intermediate_size} columns")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One rank's model: its query heads, KV heads (at least one) and MLP columns."""
    check_tensor_parallel(cfg, size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(cfg.num_kv_heads // size, 1),
                               intermediate_size=cfg.intermediate_size // size)


def kv_head_begin(cfg: ModelConfig, rank: int, size: int) -> int:
    """The first KV head rank ``rank`` keeps."""
    return rank * cfg.num_kv_heads // size


def head_rows(cfg: ModelConfig, rank: int, size: int) -> Slice | None:
    """Rank ``rank``'s rows of the LM head (vocabulary ids), or None: the whole head (the vocabulary
    does not divide by ``size``)."""
    if size == 1 or cfg.vocab_size % size:
        return None
    n = cfg.vocab_size // size
    return Slice(0, rank * n, n)


def weight_slice(name: str, cfg: ModelConfig, rank: int, size: int) -> Slice | None:
    """The part of checkpoint tensor ``name`` (Hugging Face naming) that rank ``rank`` loads; None: all of it."""
    if size == 1:
        return None
    d, local = cfg.head_dim, local_config(cfg, size)
    if ".q_proj." in name:
        return Slice(0, rank * local.num_heads * d, local.num_heads * d)
    if ".k_proj." in name or ".v_proj." in name:
        return Slice(0, kv_head_begin(cfg, rank, size) * d, local.num_kv_heads * d)
    if ".o_proj." in name:
        return Slice(1, rank * local.num_heads * d, local.num_heads * d)
    if ".gate_proj." in name or ".up_proj." in name:
        return Slice(0, rank * local.intermediate_size, local.intermediate_size)
    if ".down_proj." in name:
        return Slice(1, rank * local.intermediate_size, local.intermediate_size)
    if name == "lm_head.weight":
        return head_rows(cfg, rank, size)
    return None
