"""The batch the GPU benchmarks time: random prompts on random weights (a named shape or a folder),
added to an engine at once and prefilled the way the engine serves them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ...engine.config import RunnerConfig
from ...engine.sampling_params import SamplingParams


def add_runner_flags(p: argparse.ArgumentParser, shape: str | None = "llama-3.2-1b", device: str = "cuda") -> None:
    """The flags ``model_folder`` and ``engine_kwargs`` read: the model (``shape`` None: the embedded
    default model unless ``--shape`` or ``--model`` is given) and how its steps run."""
    p.add_argument("--shape", default=shape,
                   help="tiny, small, llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, qwen3-1.7b, sdar-1.7b, or the path "
                        "of a config.json")
    p.add_argument("--model", default=None, help="a checkpoint instead of random weights of --shape")
    p.add_argument("--device", default=device)
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true",
                   help="EXTEND/MIXED steps of up to --piecewise-cuda-graph-max-tokens replay the model in pieces")
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=RunnerConfig.piecewise_cuda_graph_max_tokens)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (a GPU each) the model is split over")


def model_folder(args: argparse.Namespace, tmp: str) -> tuple[Path, str]:
    """(folder, load_format): ``--model`` as given, else a config-only folder of ``--shape`` (a preset's
    name, or the path of a Hugging Face ``config.json``)."""
    from ...engine.models.random_checkpoint import write_config_only

    if args.model:
        return Path(args.model), "auto"
    if args.shape.endswith(".json"):
        return write_config_only(Path(tmp) / "shape", config_file(args.shape)), "dummy"
    return write_config_only(Path(tmp) / args.shape, args.shape), "dummy"


def config_file(path: str) -> dict[str, Any]:
    """A ``config.json`` given as ``--shape``, read as a dict (ValueError when it is not one)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--shape {path}: cannot read a JSON config ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"--shape {path}: a config.json holds one JSON object")
    return config


def vocab_size(folder: str | Path) -> int:
    """The vocabulary size in a model folder's ``config.json``."""
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM`` arguments every GPU benchmark takes from its shared flags (``add_runner_flags``):
    model folder aside, where the model runs and how its steps launch."""
    return {"device": args.device, "dtype": args.dtype, "attention_backend": args.attention_backend,
            "disable_cuda_graph": args.disable_cuda_graph,
            "enable_piecewise_cuda_graph": args.enable_piecewise_cuda_graph,
            "piecewise_cuda_graph_max_tokens": args.piecewise_cuda_graph_max_tokens,
            "tensor_parallel_size": args.tensor_parallel_size}


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=g)


def add_batch(llm: Any, prompts: list[list[int]], sp: SamplingParams) -> list[Any]:
    reqs = [llm.make_request(p, sp) for p in prompts]
    for r in reqs:
        llm.add_request(r)
    return reqs


def prefill(llm: Any, reqs: list[Any]) -> int:
    """``step()`` until every request has its first token (several steps when the prompts are longer
    than one chunk); returns the number of steps."""
    steps = 0
    while not all(r.output_ids for r in reqs):
        llm.step()
        steps += 1
    return steps
