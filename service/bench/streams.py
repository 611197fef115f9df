"""Many concurrent streams: N greedy streams opened at once against one ``modeserve serve`` process
from asyncio clients in separate processes; how each ended, every status code counted (the server
must cancel none; over ``--max-queued-requests`` it refuses with RESOURCE_EXHAUSTED)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from ..cli.engine_args import engine_kwargs
from .load_client import run_clients, short_prompts, status_counts
from .servers import serve


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ...engine.models.random_checkpoint import write_random_checkpoint
    from .batch import vocab_size

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_random_checkpoint(Path(tmp) / "model", args.shape))
        vocab = vocab_size(model)
        n, new = args.streams, args.max_new_tokens
        queued = args.max_queued_requests or n
        jobs = [(f"s{i}", p) for i, p in enumerate(short_prompts(n, vocab))]
        with serve(model, engine_kwargs(args), queued) as front:
            results = run_clients(front.grpc, jobs, new, n, args.processes, args.channels, args.timeout)
    seconds = max(r.end for r in results) - min(r.start for r in results)  # from the first call, not process start
    codes = status_counts(results)
    full = sum(r.code == "OK" and len(r.token_ids) == new and r.finish_reason == "length" for r in results)
    return {"bench": "streams", "model": args.model or f"random:{args.shape}", "streams": n,
            "completed": full, "short": codes.get("OK", 0) - full,  # OK, yet fewer tokens or another finish
            "refused": codes.get("RESOURCE_EXHAUSTED", 0), "cancelled": codes.get("CANCELLED", 0),
            "other_errors": {c: k for c, k in codes.items() if c not in ("OK", "RESOURCE_EXHAUSTED", "CANCELLED")},
            "status_codes": codes, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(sum(len(r.token_ids) for r in results) / seconds, 1),
            "max_new_tokens": new, "max_queued_requests": queued, "client_processes": min(args.processes, n),
            "channels_per_process": args.channels,
            "error_details": sorted({f"{r.code}: {r.details}" for r in results if r.code != "OK"})[:5]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli.engine_args import add_engine_args

    p.add_argument("--model", default=None, help="HF folder (default: random weights of --shape)")
    p.add_argument("--shape", default="tiny", help="random-weight shape when no --model")
    p.add_argument("--streams", type=int, default=10_000, help="streams opened at once")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-queued-requests", type=int, default=0, help="the server's limit (0: --streams)")
    p.add_argument("--processes", type=int, default=4, help="client processes (the streams are split over them)")
    p.add_argument("--channels", type=int, default=1, help="grpc.aio channels per client process")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each stream, seconds")
    add_engine_args(p)
