"""``modeserve bench ...``: benchmarks that print one JSON object (figure, peer or limit, ratio)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from modeserve.service.engine_args import add_engine_args


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (JSON out)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    off = kinds.add_parser("offline", help="LLM.generate on a prompt set vs transformers on the same prompts")
    off.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M)")
    off.add_argument("--num-prompts", type=int, default=32)
    off.add_argument("--new-tokens", type=int, default=64)
    off.add_argument("--min-prompt-tokens", type=int, default=16)
    off.add_argument("--max-prompt-tokens", type=int, default=512)
    off.add_argument("--length-dist", choices=["loguniform", "uniform"], default="loguniform",
                     help="prompt lengths: log-uniform (chat-like: many short, a long tail) or uniform")
    off.add_argument("--baseline", choices=["transformers", "none"], default="transformers")
    off.add_argument("--baseline-batch-size", type=int, default=None,
                     help="transformers batch size (default: all prompts in one padded batch)")
    off.add_argument("--seed", type=int, default=0)
    add_engine_args(off)
    off.set_defaults(func=run_offline)
    srv = kinds.add_parser("serving", help="decode step through in-process vs gRPC engines, with and without overlap")
    srv.add_argument("--model", default=None, help="HF folder or .gguf (default: a random model of --shape)")
    srv.add_argument("--shape", default="tiny", help="random-weight shape when no --model (tiny, llama-3.2-1b, ...)")
    srv.add_argument("--batch-sizes", default="1,32")
    srv.add_argument("--steps", type=int, default=200, help="decode steps measured per run")
    srv.add_argument("--prompt-len", type=int, default=16)
    srv.add_argument("--repeats", type=int, default=3, help="measurements per configuration (median reported)")
    srv.add_argument("--threads", type=int, default=1,
                     help="torch CPU threads per engine (in-process and remote alike; 1 leaves a core to the router)")
    srv.set_defaults(func=run_serving)
    lat = kinds.add_parser("latency", help="one batch on random weights of a named shape vs the roofline (GPU)")
    lat.add_argument("--shape", default="llama-3.2-1b", help="tiny, llama-3.2-1b, llama-3.1-8b, qwen3-0.6b")
    lat.add_argument("--model", default=None, help="a checkpoint instead of random weights")
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--output-len", type=int, default=256)
    lat.add_argument("--device", default="cuda")
    lat.add_argument("--dtype", default="bfloat16")
    lat.add_argument("--disable-cuda-graph", action="store_true")
    lat.set_defaults(func=run_latency)


def run_latency(args: argparse.Namespace) -> int:
    from modeserve.service.bench_latency import run

    print(json.dumps(run(args)))
    return 0


def run_serving(args: argparse.Namespace) -> int:
    from modeserve.service.bench_serving import run

    print(json.dumps(run(args)))
    return 0


def run_offline(args: argparse.Namespace) -> int:
    from modeserve.service.bench_offline import run

    print(json.dumps(run(args)))
    return 0
