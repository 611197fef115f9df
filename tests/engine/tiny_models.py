"""Tiny random Hugging Face models of each supported architecture, saved as HF folders.

The reference for every exactness test is the ``transformers`` model itself, run as a plain loop
of full forwards with argmax (no KV cache, no padding), so nothing of modeserve is in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

COMMON: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.15,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, model class, extra config)
ARCHS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=32), rope_theta=500000.0),
    ),
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "mistral-window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=12)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
}


def make_tiny_model(name: str, folder: Path, seed: int = 0, max_shard_size: str | None = None,
                    **overrides: Any) -> Path:
    cfg_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # biases are zero-initialised; make them matter
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.1)
    kwargs: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def load_reference(folder: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Last-position logits [V] from a full forward over ``ids``."""
    return model(torch.tensor([ids])).logits[0, -1].float()


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(reference_logits(model, ids).argmax()))
    return ids[len(prompt):]


def mixed_prompts(num: int, vocab: int, seed: int, min_len: int = 3, max_len: int = 60,
                  shared_prefix: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared_prefix,), generator=g).tolist()
    out = []
    for i in range(num):
        n = min_len + (i * 7919 % (max_len - min_len + 1))
        out.append(prefix + torch.randint(3, vocab, (n,), generator=g).tolist())
    return out


def teacher_forced_logits(test: Any, ref: Any, rtol: float) -> set[str]:
    """Step two engines (``LLM``s holding the same requests) together: each step has the same mode and
    logits equal within ``rtol`` (relative to the reference's largest logit), and both continue with
    the reference's argmax tokens. Returns the forward modes seen."""
    import numpy as np

    from modeserve.engine.forward_batch import ForwardResult

    modes = set()
    while test.scheduler.has_work:
        a, b = test.scheduler.schedule(), ref.scheduler.schedule()
        assert a is not None and b is not None and a.batch.forward_mode == b.batch.forward_mode
        modes.add(a.batch.forward_mode.name)
        la, lb = test.runner.compute_logits(a.batch), ref.runner.compute_logits(b.batch)
        torch.testing.assert_close(la, lb, rtol=rtol, atol=rtol * float(lb.abs().max()))
        tokens = lb.argmax(-1).cpu().numpy().astype(np.int64)  # both follow the same tokens
        kept = accepted_drafts(b.batch, tokens) if b.batch.forward_mode.name == "TARGET_VERIFY" else None
        test.scheduler.process_result(a, ForwardResult(tokens, accepted_lengths=kept))
        ref.scheduler.process_result(b, ForwardResult(tokens, accepted_lengths=kept))
    return modes


def accepted_drafts(batch: Any, tokens: Any) -> Any:
    """Per request of a TARGET_VERIFY batch, how many of its drafts lead with the tokens ``tokens``
    says follow each input (greedy acceptance, on the host)."""
    import numpy as np

    kept = []
    for start, n in zip((np.cumsum(batch.extend_lens) - batch.extend_lens).tolist(), batch.extend_lens.tolist()):
        k = 0
        while k < n - 1 and batch.input_ids[start + k + 1] == tokens[start + k]:
            k += 1
        kept.append(k)
    return np.array(kept, dtype=np.int64)
