"""Write a Hugging Face-style checkpoint (config.json + model.safetensors) with random weights of
a named shape, for benchmarks and tests that need a model but not its knowledge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .model_config import parse_model_config

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
          "rms_norm_eps": 1e-5, "hidden_act": "silu"}


def _llama3(hidden_size: int, intermediate_size: int, num_hidden_layers: int, head_dim: int, rope_factor: float,
            tie_word_embeddings: bool) -> dict[str, Any]:
    """A Llama 3 config: 128256-token vocabulary, 32 query and 8 KV heads, 128k positions, llama3 RoPE scaling
    of ``rope_factor`` over the original 8k."""
    return {**_LLAMA, "vocab_size": 128256, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
            "num_hidden_layers": num_hidden_layers, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": head_dim, "max_position_embeddings": 131072, "tie_word_embeddings": tie_word_embeddings,
            "rope_scaling": {"rope_type": "llama3", "factor": rope_factor, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "rope_theta": 500000.0}


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**_LLAMA, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
             "rope_theta": 10000.0, "tie_word_embeddings": False},
    "small": {**_LLAMA, "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6,
              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048,
              "rope_theta": 10000.0, "tie_word_embeddings": False},
    "llama-3.2-1b": _llama3(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                            rope_factor=32.0, tie_word_embeddings=True),
    "llama-3.1-8b": _llama3(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
                            rope_factor=8.0, tie_word_embeddings=False),
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                   "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-1.7b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                   "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645},
}

# block-diffusion (SDAR) shapes: (the Qwen3 preset of their weights, block_size, mask_token_id); apart from
# PRESETS because transformers has no "sdar" config to check them against
SDAR_PRESETS: dict[str, tuple[str, int, int]] = {"sdar-1.7b": ("qwen3-1.7b", 4, 151669)}


def sdar_config(shape: str | dict[str, Any], block_size: int, mask_token_id: int) -> dict[str, Any]:
    """The SDAR checkpoint config of ``shape``'s dimensions: SDAR keeps Qwen3's weight layout, so only the
    architecture and the block (``block_size``, ``mask_token_id``) differ."""
    return {**preset_config(shape), "architectures": ["SDARForCausalLM"], "model_type": "sdar",
            "block_size": block_size, "mask_token_id": mask_token_id}


def random_state_dict(config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random tensors under Hugging Face names for ``config`` (std 0.02; norms 1)."""
    mc = parse_model_config(config)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    sd = {"model.embed_tokens.weight": rnd(mc.vocab_size, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
               p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
               p + "mlp.gate_proj.weight": rnd(mc.intermediate_size, h),
               p + "mlp.up_proj.weight": rnd(mc.intermediate_size, h),
               p + "mlp.down_proj.weight": rnd(h, mc.intermediate_size),
               p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
               p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
        if mc.attention_bias:
            sd |= {p + "self_attn.q_proj.bias": rnd(q), p + "self_attn.k_proj.bias": rnd(kv),
                   p + "self_attn.v_proj.bias": rnd(kv)}
        if mc.qk_norm:
            sd |= {p + "self_attn.q_norm.weight": torch.ones(mc.head_dim, dtype=dtype),
                   p + "self_attn.k_norm.weight": torch.ones(mc.head_dim, dtype=dtype)}
    if not mc.tie_word_embeddings:
        sd["lm_head.weight"] = rnd(mc.vocab_size, h)
    return sd


def preset_config(shape: str | dict[str, Any]) -> dict[str, Any]:
    """The config dict of a preset name, or ``shape`` itself when it is already a config."""
    if isinstance(shape, dict):
        return shape
    if shape in SDAR_PRESETS:
        return sdar_config(*SDAR_PRESETS[shape])
    if shape not in PRESETS:
        raise ValueError(f"unknown model shape {shape!r}; presets: {sorted([*PRESETS, *SDAR_PRESETS])}")
    return PRESETS[shape]


def write_config_only(folder: str | Path, shape: str | dict[str, Any]) -> Path:
    """A folder with just ``config.json``: load it with ``load_format="dummy"``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(preset_config(shape), indent=1))
    return out


def write_random_checkpoint(folder: str | Path, shape: str | dict[str, Any], seed: int = 0,
                            dtype: torch.dtype = torch.float32) -> Path:
    """``shape``: a preset name (``tiny``, ``llama-3.2-1b``, ``qwen3-1.7b``, ``sdar-1.7b``, ...) or a config dict."""
    out = write_config_only(folder, shape)
    save_file(random_state_dict(preset_config(shape), seed, dtype), str(out / "model.safetensors"))
    return out
