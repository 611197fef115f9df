"""Elementwise ops of the decoder, as torch references (GPU fused versions share these signatures)."""

from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H] (or [T, heads, D] for q/k norms), weight: [H]
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * I] = [gate | up] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), incl. Llama 3 and linear scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type != "llama3":
        return inv_freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """Cache [max_positions, head_dim] = [cos | sin] halves, float32."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding. q: [T, Hq, D], k: [T, Hkv, D], positions: [T]."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(q.dtype)  # [T, 1, D]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write k, v: [T, Hkv, D] into k_cache, v_cache: [num_slots, Hkv, D] at slots loc: [T]."""
    k_cache.index_copy_(0, loc, k.to(k_cache.dtype))
    v_cache.index_copy_(0, loc, v.to(v_cache.dtype))


def apply_rotary_and_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` then ``store_kv`` of the rotated k and of v; returns the rotated (q, k)."""
    q, k = apply_rotary(q, k, positions, cos_sin)
    store_kv(k_cache, v_cache, loc, k, v)
    return q, k


def argmax(x: torch.Tensor, into: torch.Tensor | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
    """x: [S, V] -> [S] int64: the index of each row's first maximum; with ``into`` and ``at`` ([S]
    int64 indices into it) the result is also written at ``into[at]``."""
    out = torch.argmax(x, dim=-1)
    if into is not None:
        into[at] = out
    return out


def record_tokens(req_to_token: torch.Tensor, token_ids: torch.Tensor, last_token: torch.Tensor, rows: torch.Tensor,
                  positions: torch.Tensor, loc: torch.Tensor, ids: torch.Tensor) -> None:
    """A step's token bookkeeping, in place. rows/positions/loc/ids: [T] int64; req_to_token and
    token_ids: [max_reqs, max_context]; last_token: [max_reqs].

    A placeholder id (< 0: the token row ``rows[i]`` samples in the step still running) becomes
    ``last_token[rows[i]]`` in ``ids``; then ``req_to_token[rows, positions] = loc`` and
    ``token_ids[rows, positions] = ids``."""
    ids.copy_(torch.where(ids < 0, last_token[rows], ids))
    req_to_token[rows, positions] = loc
    token_ids[rows, positions] = ids
