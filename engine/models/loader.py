"""Find a checkpoint (HF folder or GGUF file), parse its config, build the model on ``meta``,
allocate it once on the target device and stream the weights into it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch
from safetensors import safe_open

from ..distributed.shard import Slice, head_rows, local_config, weight_slice
from .gguf_loader import iter_gguf_tensors, read_gguf_checkpoint
from .llama import LlamaForCausalLM
from .model_config import ModelConfig, parse_model_config
from .model_path import checked_model_path
from ...kernels.op_set import TORCH_OPS, KernelOps

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Checkpoint(NamedTuple):
    path: Path
    config: ModelConfig
    is_gguf: bool
    num_tensors: int
    dummy: bool = False  # random weights made on the device (benchmarks): config.json only


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[name]


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def open_checkpoint(path: str | Path, load_format: str = "auto") -> Checkpoint:
    """``load_format`` ``dummy``: only the folder's config.json is read; weights are random."""
    p = checked_model_path(path, "; give a GGUF file or a Hugging Face folder")
    if p.is_file():
        ckpt = read_gguf_checkpoint(p)
        return Checkpoint(p, parse_model_config(ckpt.config, name=p.stem), True, 0)
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model folder {str(p)!r} has no config.json")
    if load_format == "dummy":
        return Checkpoint(p, parse_model_config(json.loads(cfg_file.read_text()), name=p.name), False, 0, True)
    files = _safetensors_files(p)
    if not files:
        raise ValueError(f"model folder {str(p)!r} has no .safetensors weights")
    config = parse_model_config(json.loads(cfg_file.read_text()), name=p.name)
    return Checkpoint(p, config, False, len(files))


def iter_weights(ckpt: Checkpoint, dtype: torch.dtype,
                 part: Callable[[str], Slice | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor; with ``part``, only the slice of each that it names (read from the file
    alone: a tensor-parallel rank reads its shard)."""
    if ckpt.is_gguf:
        if part is not None:
            raise ValueError("tensor parallelism loads Hugging Face safetensors folders, not GGUF files")
        yield from iter_gguf_tensors(ckpt.path, dtype)
        return
    for file in _safetensors_files(ckpt.path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                where = part(name) if part is not None else None
                if where is None:
                    yield name, f.get_tensor(name).to(dtype)
                    continue
                cut = slice(where.start, where.start + where.length)
                data = f.get_slice(name)
                yield name, (data[cut] if where.dim == 0 else data[:, cut]).to(dtype)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights on the model's own device: N(0, std) matrices and biases, norms 1. The same
    seed gives the same weights (a shape loaded twice, as a speculative target and its own draft, is
    one model)."""
    generator: torch.Generator | None = None
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=generator)


def load_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    progress: Callable[[str], None] | None = None,
    kops: KernelOps = TORCH_OPS,
    tensor_parallel: tuple[int, int] = (0, 1),
) -> LlamaForCausalLM:
    """Build on ``meta``, allocate once on ``device`` (uninitialised), then copy each tensor in.
    ``tensor_parallel`` (rank, size): that rank's share of the model, its slices of the weights."""
    rank, size = tensor_parallel
    part, rows = None, None
    if size > 1:
        full = ckpt.config
        ckpt = ckpt._replace(config=local_config(full, size))
        part = functools.partial(weight_slice, cfg=full, rank=rank, size=size)
        rows = head_rows(full, rank, size)
    with torch.device("meta"):
        model = LlamaForCausalLM(ckpt.config, kops, rows.length if rows is not None else None)
    model = model.to(dtype).to_empty(device=device)
    if ckpt.config.tie_word_embeddings:  # the head is the embedding (this rank's rows of it)
        embedding = model.embed_tokens.weight
        model.lm_head.weight = embedding if rows is None else torch.nn.Parameter(
            embedding.detach().narrow(0, rows.start, rows.length), requires_grad=False)

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_weights(ckpt, dtype, part):
            if progress is not None:
                progress(name)
            yield name, tensor

    if ckpt.dummy:
        init_dummy_weights(model)
    else:
        model.load_weights(tracked())
    model.init_buffers(max_positions)
    return model.eval()
