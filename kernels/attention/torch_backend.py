"""Reference attention over the paged KV cache in plain torch (CPU default, correctness oracle).

Decode rows (one query each) are batched into padded SDPA calls, one per group of similar lengths; extend rows run one SDPA per
request with a bottom-right causal mask (queries at positions prefix..seq-1 see keys 0..their own), or a
block-causal one for DLLM_EXTEND (a query sees the keys up to the end of its block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionInputs


@dataclass
class _ExtendRow:
    token_start: int
    token_end: int
    kv_idx: torch.Tensor  # [S] slots
    mask: torch.Tensor | None  # [E, S] additive (0 or -inf); None: no prefix and no window (plain causal)


@dataclass
class _DecodeRows:
    token_idx: torch.Tensor  # [Bd] row of each decode token in the step
    kv_idx: torch.Tensor  # [Bd, S_max] slots (0 where padded)
    mask: torch.Tensor  # [Bd, 1, 1, S_max] additive (0 or -inf)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> additive mask; faster than bool masks in the CPU kernel."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _length_buckets(seq_lens: list[int], min_fill: float = 0.6) -> list[list[int]]:
    """Group row indices so that in each group every length is >= ``min_fill`` x the group's
    longest: one padded SDPA per group wastes little on padding."""
    order = sorted(range(len(seq_lens)), key=lambda j: -seq_lens[j])
    groups: list[list[int]] = []
    for j in order:
        if groups and seq_lens[j] >= min_fill * seq_lens[groups[-1][0]]:
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, inputs: AttentionInputs) -> None:
        device = inputs.req_to_token.device
        self._out_cache_loc = inputs.out_cache_loc
        self._extend: list[_ExtendRow] = []
        decode_rows: list[int] = []
        decode_tokens: list[int] = []
        start = 0
        for i, (prefix, ext) in enumerate(zip(inputs.prefix_lens_cpu, inputs.extend_lens_cpu)):
            seq = prefix + ext
            if ext == 1 and not inputs.block_size:
                decode_rows.append(i)
                decode_tokens.append(start)
            else:
                kv_idx = inputs.req_to_token[inputs.req_pool_indices[i], :seq]
                mask: torch.Tensor | None = None
                if prefix or inputs.block_size or (self.sliding_window is not None and seq > self.sliding_window):
                    q_pos = torch.arange(prefix, seq, device=device)[:, None]
                    k_pos = torch.arange(seq, device=device)[None, :]
                    if inputs.block_size:  # block-causal: up to the end of the query's block
                        allowed = k_pos < (q_pos // inputs.block_size + 1) * inputs.block_size
                    else:
                        allowed = k_pos <= q_pos
                    if self.sliding_window is not None:
                        allowed &= q_pos - k_pos < self.sliding_window
                    mask = _additive(allowed, inputs.dtype)
                self._extend.append(_ExtendRow(start, start + ext, kv_idx, mask))
            start += ext
        seq_lens_cpu = inputs.seq_lens_cpu
        decode_lens = [seq_lens_cpu[i] for i in decode_rows]
        self._decode = [
            self._decode_group(inputs, [decode_rows[j] for j in group], [decode_tokens[j] for j in group],
                               decode_lens[group[0]])
            for group in _length_buckets(decode_lens)
        ]

    def _decode_group(self, inputs: AttentionInputs, rows_cpu: list[int], tokens_cpu: list[int],
                      s_max: int) -> _DecodeRows:
        """One padded group; ``s_max`` is its longest sequence (groups start with their longest)."""
        device = inputs.req_to_token.device
        rows = torch.tensor(rows_cpu, device=device)
        seq_lens = inputs.seq_lens[rows]  # [Bd]
        k_pos = torch.arange(s_max, device=device)[None, :]
        valid = k_pos < seq_lens[:, None]
        if self.sliding_window is not None:
            valid &= (seq_lens[:, None] - 1 - k_pos) < self.sliding_window
        kv_idx = inputs.req_to_token[inputs.req_pool_indices[rows], :s_max]
        kv_idx = torch.where(valid, kv_idx, torch.zeros_like(kv_idx))
        return _DecodeRows(torch.tensor(tokens_cpu, device=device), kv_idx,
                           _additive(valid[:, None, None, :], inputs.dtype))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D]
        if not kv_stored:
            self.kv_cache.write(layer_id, self._out_cache_loc, k, v)
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        out = torch.empty_like(q)
        for row in self._extend:
            qi = q[row.token_start : row.token_end].transpose(0, 1)  # [Hq, E, D]
            if row.mask is None:  # no prefix: this step's own k/v, plain causal
                ki = k[row.token_start : row.token_end].transpose(0, 1)  # [Hkv, E, D]
                vi = v[row.token_start : row.token_end].transpose(0, 1)
            else:
                ki = k_cache.index_select(0, row.kv_idx).transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
                vi = v_cache.index_select(0, row.kv_idx).transpose(0, 1).to(q.dtype)
            # 4-D inputs: 3-D ones fall back to the slow math kernel on CPU
            oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=row.mask,
                                                is_causal=row.mask is None, scale=self.scale, enable_gqa=True)
            out[row.token_start : row.token_end] = oi[0].transpose(0, 1)
        for d in self._decode:
            bd, s_max = d.kv_idx.shape
            qd = q[d.token_idx][:, :, None, :]  # [Bd, Hq, 1, D]
            # index_select on the flat index is several times faster than 2-D advanced indexing on CPU
            kd = k_cache.index_select(0, d.kv_idx.view(-1)).view(bd, s_max, *k_cache.shape[1:])
            vd = v_cache.index_select(0, d.kv_idx.view(-1)).view(bd, s_max, *v_cache.shape[1:])
            kd, vd = kd.transpose(1, 2).to(q.dtype), vd.transpose(1, 2).to(q.dtype)  # [Bd, Hkv, S, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=self.scale, enable_gqa=True)
            out[d.token_idx] = od[:, :, 0, :]
        return out
