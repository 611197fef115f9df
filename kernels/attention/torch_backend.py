"""Reference attention over the paged KV cache in plain torch (CPU default, correctness oracle).

Decode rows (one query each) are batched into one padded SDPA call; extend rows run one SDPA per
request with a bottom-right causal mask (queries at positions prefix..seq-1 see keys 0..their own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from modeserve.kernels.attention.base import AttentionBackend, AttentionInputs


@dataclass
class _ExtendRow:
    token_start: int
    token_end: int
    kv_idx: torch.Tensor  # [S] slots
    mask: torch.Tensor  # [E, S] bool, True = attend


@dataclass
class _DecodeRows:
    token_idx: torch.Tensor  # [Bd] row of each decode token in the step
    kv_idx: torch.Tensor  # [Bd, S_max] slots (0 where padded)
    mask: torch.Tensor  # [Bd, 1, 1, S_max] bool


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
            if ext == 1:
                decode_rows.append(i)
                decode_tokens.append(start)
            else:
                kv_idx = inputs.req_to_token[inputs.req_pool_indices[i], :seq]
                q_pos = torch.arange(prefix, seq, device=device)[:, None]
                k_pos = torch.arange(seq, device=device)[None, :]
                mask = k_pos <= q_pos
                if self.sliding_window is not None:
                    mask &= q_pos - k_pos < self.sliding_window
                self._extend.append(_ExtendRow(start, start + ext, kv_idx, mask))
            start += ext
        self._decode: _DecodeRows | None = None
        if decode_rows:
            rows = torch.tensor(decode_rows, device=device)
            seq_lens = inputs.seq_lens[rows]  # [Bd]
            s_max = max(inputs.seq_lens_cpu[i] for i in decode_rows)
            k_pos = torch.arange(s_max, device=device)[None, :]
            valid = k_pos < seq_lens[:, None]
            if self.sliding_window is not None:
                valid &= (seq_lens[:, None] - 1 - k_pos) < self.sliding_window
            kv_idx = inputs.req_to_token[inputs.req_pool_indices[rows], :s_max]
            kv_idx = torch.where(valid, kv_idx, torch.zeros_like(kv_idx))
            self._decode = _DecodeRows(
                torch.tensor(decode_tokens, device=device), kv_idx, valid[:, None, None, :]
            )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D]
        self.kv_cache.write(layer_id, self._out_cache_loc, k, v)
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        out = torch.empty_like(q)
        for row in self._extend:
            qi = q[row.token_start : row.token_end].transpose(0, 1)  # [Hq, E, D]
            ki = k_cache[row.kv_idx].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
            vi = v_cache[row.kv_idx].transpose(0, 1).to(q.dtype)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=row.mask, scale=self.scale, enable_gqa=True)
            out[row.token_start : row.token_end] = oi.transpose(0, 1)
        if self._decode is not None:
            d = self._decode
            qd = q[d.token_idx][:, :, None, :]  # [Bd, Hq, 1, D]
            kd = k_cache[d.kv_idx].transpose(1, 2).to(q.dtype)  # [Bd, Hkv, S, D]
            vd = v_cache[d.kv_idx].transpose(1, 2).to(q.dtype)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=self.scale, enable_gqa=True)
            out[d.token_idx] = od[:, :, 0, :]
        return out
