"""Read a GGUF checkpoint as a Hugging Face config dict plus HF-named, HF-shaped tensors.

Invariants:
* Metadata is parsed by a small reader of our own (little-endian GGUF v2/v3) that skips big
  arrays such as the tokenizer vocabulary, so reading the config costs milliseconds, not the
  seconds that ``gguf.GGUFReader`` spends building a view per vocabulary entry.
* Tensors come out one at a time, dequantised with ``gguf.quants.dequantize``, in HF layout
  ``[out_features, in_features]``; for ``llama`` files the q/k rows that llama.cpp's converter
  permuted for its rotary layout are permuted back (qwen2/qwen3 files are not permuted).
"""

from __future__ import annotations

import mmap
import re
import struct
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

_MAGIC = b"GGUF"
_MAX_KEPT_ARRAY = 256  # longer metadata arrays (vocabulary, merges, scores) are skipped
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFCheckpoint(NamedTuple):
    """A GGUF file's hyper-parameters as a HF ``config.json``-style dict, and its path."""

    config: dict[str, object]
    path: Path


class _TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the fastest-varying (HF's last) axis
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file


class _Header(NamedTuple):
    metadata: dict[str, Any]  # scalars, strings and short arrays; long arrays map to None
    tensors: list[_TensorInfo]


class _Cursor:
    """Sequential little-endian reader over a byte buffer; struct errors mean truncation."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = int(self.scalar("Q"))
        raw = self.buf[self.pos : self.pos + n]
        if len(raw) != n:
            raise struct.error("string runs past the end of the file")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = int(self.scalar("I")), int(self.scalar("Q"))
            if count > _MAX_KEPT_ARRAY and item_type in _SCALAR_FORMATS:
                self.pos += count * struct.calcsize(_SCALAR_FORMATS[item_type])
                return None
            items = [self.value(item_type) for _ in range(count)]
            return None if count > _MAX_KEPT_ARRAY else items
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")
        value = self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _FLOAT32:  # shortest decimal that round-trips in float32: 1e-05, not 9.99999974e-06
            value = float(str(np.float32(value)))
        return value


def _read_header(path: str | Path) -> _Header:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"GGUF file {str(p)!r} does not exist")
    with p.open("rb") as f:
        if f.read(4) != _MAGIC:
            raise ValueError(f"{str(p)!r} is not a GGUF file (bad magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf)
            cur.pos = 4
            try:
                version = int(cur.scalar("I"))
                if version not in (2, 3):
                    raise ValueError(f"{str(p)!r}: unsupported GGUF version {version} (only little-endian v2/v3)")
                n_tensors, n_kv = int(cur.scalar("Q")), int(cur.scalar("Q"))
                metadata: dict[str, Any] = {}
                for _ in range(n_kv):
                    key = cur.string()
                    metadata[key] = cur.value(int(cur.scalar("I")))
                raw_infos = []
                for _ in range(n_tensors):
                    name = cur.string()
                    n_dims = int(cur.scalar("I"))
                    dims = tuple(int(cur.scalar("Q")) for _ in range(n_dims))
                    raw_infos.append((name, dims, int(cur.scalar("I")), int(cur.scalar("Q"))))
            except struct.error as exc:
                raise ValueError(f"{str(p)!r}: truncated or corrupt GGUF header ({exc})") from exc
            alignment = int(metadata.get("general.alignment", 32))
            data_start = -(-cur.pos // alignment) * alignment
    tensors = [_TensorInfo(n, d, GGMLQuantizationType(t), data_start + off) for n, d, t, off in raw_infos]
    return _Header(metadata, tensors)


def _config_from_header(header: _Header, path: Path) -> dict[str, Any]:
    md = header.metadata
    arch = md.get("general.architecture")
    if arch not in _HF_ARCHITECTURES:
        raise ValueError(f"{str(path)!r}: unsupported GGUF architecture {arch!r}; supported: {sorted(_HF_ARCHITECTURES)}")
    names = {t.name for t in header.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{str(path)!r}: per-frequency rope factors (rope_freqs, Llama-3.1 style) are not supported")

    def need(key: str) -> int | float:
        value = md.get(f"{arch}.{key}")
        if not isinstance(value, (int, float)):
            raise ValueError(f"{str(path)!r}: GGUF metadata lacks numeric {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    rotary = md.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"{str(path)!r}: partial rotary ({rotary} of {head_dim} dims) is not supported")
    embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError(f"{str(path)!r}: GGUF file has no token_embd.weight tensor")
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES[str(arch)]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(md.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(md.get(f"{arch}.vocab_size", embed.dims[1])),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        rope: dict[str, Any] = {"rope_type": scaling, "factor": float(md.get(f"{arch}.rope.scaling.factor", 1.0))}
        original = md.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = original
        config["rope_scaling"] = rope
    return config


def read_gguf_checkpoint(path: str | Path) -> GGUFCheckpoint:
    """Parse a GGUF file's metadata (no tensor data) into a HF-style config dict.

    Raises ValueError for a missing file, a non-GGUF or truncated file, or an architecture other
    than llama / qwen2 / qwen3.
    """
    p = Path(path).expanduser()
    return GGUFCheckpoint(_config_from_header(_read_header(p), p), p)


def _hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name; None for an unknown tensor."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and suffix == "weight":
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.{match.group(3)}"


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's ``permute``: per head it stored rows as (dim/2, 2) interleaved pairs;
    HF wants (2, dim/2) halves. Works for weights ``[rows, in]`` and biases ``[rows]``."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows over {n_head} heads")
    pairs = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


def _row_bytes(info: _TensorInfo, path: Path) -> int:
    """Bytes per row (the ggml ``dims[0]`` axis) of a tensor's stored, possibly quantised, data."""
    block_size, type_size = GGML_QUANT_SIZES[info.qtype]
    if info.dims[0] % block_size:
        raise ValueError(f"{str(path)!r}: tensor {info.name} rows of {info.dims[0]} are not whole {block_size}-blocks")
    return info.dims[0] // block_size * type_size


def iter_gguf_tensors(path: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` one tensor at a time, dequantised and cast to ``dtype``.

    Validation (file, architecture, unknown tensor names, tensor extents) happens eagerly, before
    the first tensor, so a bad file raises ValueError at the call rather than mid-load.
    """
    p = Path(path).expanduser()
    header = _read_header(p)
    config = _config_from_header(header, p)
    file_size = p.stat().st_size
    plan: list[tuple[str, _TensorInfo, int, int]] = []
    for info in header.tensors:
        hf_name = _hf_name(info.name)
        if hf_name is None:
            raise ValueError(f"{str(p)!r}: GGUF tensor {info.name!r} has no Hugging Face counterpart here")
        row_bytes = _row_bytes(info, p)
        n_bytes = row_bytes * int(np.prod(info.dims[1:]))
        if info.offset + n_bytes > file_size:
            raise ValueError(f"{str(p)!r}: tensor {info.name} runs past the end of the file (truncated?)")
        plan.append((hf_name, info, row_bytes, n_bytes))
    permute_heads: dict[str, int] = {}
    if config["model_type"] == "llama":  # llama.cpp permutes q/k only for llama-arch models
        permute_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    return _generate(p, plan, permute_heads, dtype)


def _generate(
    path: Path, plan: list[tuple[str, _TensorInfo, int, int]], permute_heads: dict[str, int], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for hf_name, info, row_bytes, n_bytes in plan:
        rows = data[info.offset : info.offset + n_bytes].reshape(-1, row_bytes)
        array = dequantize(rows, info.qtype).reshape(tuple(reversed(info.dims)))
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy()).float()
        kind = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        if kind in permute_heads:
            tensor = _unpermute(tensor, permute_heads[kind])
        yield hf_name, tensor.to(dtype)
