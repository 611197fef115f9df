"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Projections are fused (qkv_proj, gate_up_proj); ``load_weights`` maps Hugging Face names onto
the fused shards. Attention goes through the step's ``AttentionBackend``.
"""

from __future__ import annotations

from typing import Iterable, cast

import torch
from torch import nn

from .linear import Linear
from .model_config import ModelConfig
from ...kernels import ops
from ...kernels.attention.base import AttentionBackend
from ...kernels.op_set import TORCH_OPS, KernelOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kops = kops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        return self.kops.add_rms_norm(x, residual, self.weight, self.eps)

    def after(self, proj: Linear, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_forward(proj(x), residual)``, the add and the norm inside the projection's GEMV where it has one."""
        return proj.forward_add_norm(x, residual, self.weight, self.eps, self.kops.add_rms_norm)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kops: KernelOps) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.kops = kops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kops)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        # x: [T, hidden], positions: [T]
        return self.o_proj(self.attend(positions, x, cos_sin, attn))

    def attend(
        self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Attention before the output projection: [T, hidden] -> [T, Hq * D]."""
        q, k, v = self.project(x)
        # decode steps: rotary, the KV-cache store and attention in one kernel where the backend has it
        out = attn.forward_decode_rotary(q, k, v, positions, cos_sin, self.layer_id)
        if out is None:  # rotary and the KV-cache store in one op (one kernel with the Triton ops), then attention
            q, k = self.rotate_and_store(q, k, v, positions, cos_sin, attn.kv_destination(self.layer_id))
            out = attn.forward(q, k, v, self.layer_id, kv_stored=True)  # [T, Hq, D]
        return out.reshape(-1, self.q_size)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of x [T, hidden], q/k normalised where the model does that."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, dest: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k); the rotated k and v stored at ``dest`` = (k_cache, v_cache, out_cache_loc)."""
        return self.kops.apply_rotary_and_store_kv(q, k, v, positions, cos_sin, *dest)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, kops: KernelOps) -> None:
        super().__init__()
        self.kops = kops
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(x))

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP before its down projection: [T, hidden] -> [T, intermediate]."""
        return self.kops.silu_and_mul(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kops: KernelOps) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, kops)
        self.mlp = LlamaMLP(cfg, kops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kops)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos_sin: torch.Tensor,
        attn: AttentionBackend,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input, normalised already; residual: the stream's sum so far. Returns the
        next layer's normalised input (``next_norm``: its input norm, or the model's final norm) and
        the new residual: each residual add and norm follows the projection before it (in one
        kernel where that projection is a GEMV with the epilogue)."""
        return self.after_attention(self.self_attn.attend(positions, x, cos_sin, attn), residual, next_norm)

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor,
                        next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its attention's output [T, Hq * D] on: (next layer's normalised input, residual)."""
        x, residual = self.post_attention_layernorm.after(self.self_attn.o_proj, attn_out, residual)
        return next_norm.after(self.mlp.down_proj, self.mlp.act(x), residual)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our fragment, shard index or None)
    _STACKED = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: ModelConfig, kops: KernelOps = TORCH_OPS, head_rows: int | None = None) -> None:
        """``head_rows``: the LM head's vocabulary rows on this tensor-parallel rank (None: all of them;
        a part is not tied to the embedding here: the loader ties it to the embedding's rows)."""
        super().__init__()
        self.config = cfg
        self.kops = kops
        # an explicit (uninitialised) weight: the loader builds on ``meta`` and copies every tensor in,
        # and nn.Embedding's own random init there imports torch._dynamo and Triton (~1 s at start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, kops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kops)
        self.lm_head = Linear(cfg.hidden_size, head_rows or cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings and head_rows is None:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def init_buffers(self, max_positions: int) -> None:
        rope = self.config.rope
        inv_freq = ops.rope_inv_freq(
            self.config.head_dim,
            rope.theta,
            rope.rope_type,
            rope.factor,
            rope.low_freq_factor,
            rope.high_freq_factor,
            rope.original_max_position_embeddings,
        )
        self.cos_sin = ops.rope_cos_sin(inv_freq.to(self.embed_tokens.weight.device), max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x, residual = self.embed(input_ids)
        return self.run_layers(x, residual, positions, attn, 0, self.config.num_layers)[0]

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                   begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [begin, end) on (layer ``begin``'s normalised input, residual): layer ``end``'s
        (normalised input, residual), the final-normed hidden states [T, hidden] as its first when
        ``end`` is the last layer."""
        layers, norms = self.decoder_layers(), self.next_norms()
        for layer, next_norm in zip(layers[begin:end], norms[begin:end]):
            x, residual = layer(positions, x, residual, self.cos_sin, attn, next_norm)
        return x, residual

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(first layer's normalised input, residual) of input_ids [T]."""
        residual = self.embed_tokens(input_ids)
        return cast(LlamaDecoderLayer, self.layers[0]).input_layernorm(residual), residual

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast(list[LlamaDecoderLayer], list(self.layers))

    def next_norms(self) -> list[RMSNorm]:
        """Per layer, the norm of what follows it: the next layer's input norm, or the final norm."""
        return [layer.input_layernorm for layer in self.decoder_layers()[1:]] + [self.norm]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, V] in the model's dtype (argmax needs no fp32 copy; sampling converts)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the already-allocated parameters."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            shard: int | None = None
            for frag, (ours, idx) in self._STACKED.items():
                if frag in name:
                    name, shard = name.replace(frag, ours), idx
                    break
            if name not in params:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(f"checkpoint tensor {hf_name!r} matches no parameter of {type(self).__name__}")
            param = params[name]
            dest = self._shard_view(name, param, shard)
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add(f"{name}#{shard}")
        expected = {f"{n}#{s}" for n, p in params.items() for s in self._shards_of(n)}
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _shards_of(self, name: str) -> list[int | None]:
        if ".qkv_proj." in name:
            return [0, 1, 2]
        if ".gate_up_proj." in name:
            return [0, 1]
        return [None]

    def _shard_view(self, name: str, param: torch.Tensor, shard: int | None) -> torch.Tensor:
        if shard is None:
            return param.data
        if ".qkv_proj." in name:
            cfg = self.config
            sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])
