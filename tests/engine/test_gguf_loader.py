"""GGUF loader checked against an independent reference: transformers' own GGUF loading."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from modeserve.engine.default_model import default_model_path
from modeserve.engine.models.gguf_loader import GGUFCheckpoint, iter_gguf_tensors, read_gguf_checkpoint


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_tensors(gguf_path, torch.float32))


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)


def _compare(ours: dict[str, torch.Tensor], model: Any, tied: bool) -> None:
    ref = model.state_dict()
    expected = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.shape == ref[name].shape, name
        if not torch.equal(tensor, ref[name]):  # fast path (allclose is slow on CPU); tolerance below
            torch.testing.assert_close(tensor, ref[name], atol=1e-6, rtol=1e-6, msg=name)


def test_every_tensor_matches_transformers(ours: dict[str, torch.Tensor], reference: Any) -> None:
    assert len(ours) == 2 + 30 * 9  # embed + final norm + 9 per layer; tied: no lm_head
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    _compare(ours, reference, tied=True)


def test_config_matches_transformers(gguf_path: Path, reference: Any) -> None:
    ckpt = read_gguf_checkpoint(gguf_path)
    assert isinstance(ckpt, GGUFCheckpoint) and ckpt.path == gguf_path
    cfg, ref = ckpt.config, reference.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    ):  # fmt: skip
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert cfg["rms_norm_eps"] == 1e-05  # float32 metadata is given its shortest decimal
    assert "rope_scaling" not in cfg


def test_dtype_and_laziness(gguf_path: Path, ours: dict[str, torch.Tensor]) -> None:
    first = list(itertools.islice(iter_gguf_tensors(gguf_path, torch.bfloat16), 2))
    for name, tensor in first:
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, ours[name].to(torch.bfloat16))


def _write_tiny(path: Path, arch: str, *, bias: bool = False, qk_norm: bool = False, head_dim: int = 16) -> None:
    """A random float32 GGUF: hidden 64, 4 heads, 2 kv heads, 2 layers, vocab 128, untied for llama."""
    rng = np.random.default_rng(0)
    hidden, heads, kv, ffn, vocab = 64, 4, 2, 96, 128

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    w.add_tensor("output_norm.weight", rand(hidden))
    if arch == "llama":
        w.add_tensor("output.weight", rand(vocab, hidden))
    for i in range(2):
        shapes = {
            "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
            "attn_q.weight": (heads * head_dim, hidden), "attn_k.weight": (kv * head_dim, hidden),
            "attn_v.weight": (kv * head_dim, hidden), "attn_output.weight": (hidden, heads * head_dim),
            "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
        }  # fmt: skip
        if bias:
            shapes.update({"attn_q.bias": (heads * head_dim,), "attn_k.bias": (kv * head_dim,), "attn_v.bias": (kv * head_dim,)})
        if qk_norm:
            shapes.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}", rand(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("arch", "kwargs", "hf_arch"),
    [
        ("llama", {}, "LlamaForCausalLM"),  # 4 q heads vs 2 kv heads: both un-permutes exercised
        ("qwen2", {"bias": True}, "Qwen2ForCausalLM"),  # not permuted, q/k/v biases
        ("qwen3", {"qk_norm": True, "head_dim": 128}, "Qwen3ForCausalLM"),  # head_dim != hidden / heads
    ],
)
def test_tiny_architectures_match_transformers(tmp_path: Path, arch: str, kwargs: dict[str, Any], hf_arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    _write_tiny(path, arch, **kwargs)
    cfg = read_gguf_checkpoint(path).config
    assert cfg["architectures"] == [hf_arch]
    assert cfg["tie_word_embeddings"] is (arch != "llama")
    assert cfg["head_dim"] == kwargs.get("head_dim", 16)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    _compare(dict(iter_gguf_tensors(path, torch.float32)), model, tied=arch != "llama")


def test_missing_file_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_gguf_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        iter_gguf_tensors(tmp_path / "nope.gguf", torch.float32)  # eager: raises before iteration


def test_non_gguf_files_are_value_errors(tmp_path: Path, gguf_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("this is not a GGUF file\n")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_checkpoint(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_checkpoint(empty)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[:4096])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_checkpoint(truncated)


def test_unsupported_architecture_is_value_error(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        read_gguf_checkpoint(path)


def test_truncated_tensor_data_is_value_error_before_iteration(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    _write_tiny(path, "llama")
    path.write_bytes(path.read_bytes()[:-100])
    assert read_gguf_checkpoint(path).config["num_hidden_layers"] == 2  # metadata is still whole
    with pytest.raises(ValueError, match="past the end of the file"):
        iter_gguf_tensors(path, torch.float32)
