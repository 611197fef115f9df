"""Data-parallel scaling on CPU: the same offered load through one router over 1, 2, 4 ... engine
processes (one torch thread each); output tokens/s and the ratio to one engine, next to the ideal
(linear up to the machine's cores, which the router shares)."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ...engine.config import SchedulerConfig
from .decode_step import remote_engine
from ..rpc.client import GenerateClient


def _throughput(model: str, num_engines: int, prompts: list[list[int]], new_tokens: int,
                engine_args: dict[str, Any]) -> float:
    from ..router.remote import RemoteRouterConfig, start_remote_router

    with contextlib.ExitStack() as stack:
        addresses = []
        for _ in range(num_engines):
            gen = remote_engine(model, engine_args, 1)
            addresses.append(next(gen))
            stack.callback(gen.close)
        app = start_remote_router("127.0.0.1:0", addresses, None,
                                  RemoteRouterConfig(SchedulerConfig(), dispatch="least-loaded"))
        stack.callback(app.stop, 1.0)
        client = GenerateClient(f"127.0.0.1:{app.port}")
        stack.callback(client.close)

        def one(p: list[int]) -> int:
            return len(client.generate(token_ids=p, max_new_tokens=new_tokens, ignore_eos=True).token_ids)

        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(one, prompts[: 2 * num_engines]))  # warm-up
            start = time.perf_counter()
            produced = sum(pool.map(one, prompts))
            return produced / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ...engine.models.random_checkpoint import write_random_checkpoint

    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(write_random_checkpoint(Path(tmp.name) / "model", args.shape))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    engine_args = {"page_size": 16, "max_running_requests": args.num_prompts}
    counts = [int(n) for n in args.engines.split(",")]
    tput = {n: _throughput(model, n, prompts, args.new_tokens, engine_args) for n in counts}
    tmp.cleanup()
    cores = os.cpu_count() or 1
    return {"bench": "dp", "model": args.model or f"random:{args.shape}", "cpu_cores": cores,
            "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "output_tokens_per_s": {str(n): round(t, 1) for n, t in tput.items()},
            "scaling_vs_1": {str(n): round(t / tput[counts[0]], 2) for n, t in tput.items()},
            "ideal_scaling": {str(n): min(n, cores) for n in counts}}
