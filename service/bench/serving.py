"""Serving load generator: fixed-length greedy requests over gRPC and/or the OpenAI HTTP API on
loopback against ``modeserve serve`` and ``modeserve router`` + ``engine`` processes, a closed loop at each concurrency, from
asyncio clients in separate processes; output tok/s, TTFT and ITL per target and concurrency, next
to the offline figures of the same workload measured in the same run (``offline_ref``)."""

from __future__ import annotations

import argparse
import tempfile
from typing import Any, Sequence

from ..cli.engine_args import add_engine_args, engine_kwargs
from .load_client import StreamResult, percentile, run_clients, status_counts
from .servers import server

TARGETS = {"serve": ("serve",), "router": ("router",), "both": ("serve", "router")}
APIS = {"grpc": ("grpc",), "http": ("http",), "both": ("grpc", "http")}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def summarize(results: Sequence[StreamResult], output_len: int) -> dict[str, Any]:
    """Output tok/s over the run's wall time (first call to last end), TTFT and ITL percentiles (ms)."""
    ok = [r for r in results if r.code == "OK" and len(r.token_ids) == output_len]
    seconds = max(r.end for r in results) - min(r.start for r in results)
    ttft = [r.first - r.start for r in ok if r.first is not None]
    itl = [g for r in ok for g in r.gaps]
    return {"completed": len(ok), "failed": len(results) - len(ok), "status_codes": status_counts(results),
            "seconds": round(seconds, 3), "output_tokens_per_s": round(sum(len(r.token_ids) for r in ok) / seconds, 1),
            "ttft_ms_p50": _ms(percentile(ttft, 50)), "ttft_ms_p99": _ms(percentile(ttft, 99)),
            "itl_ms_p50": _ms(percentile(itl, 50)), "itl_ms_p99": _ms(percentile(itl, 99))}


def workload_engine_args(args: argparse.Namespace, max_concurrency: int) -> dict[str, Any]:
    """The engine arguments of every server process and of the offline run: the flags given, the rest
    sized for the workload (every request of the highest concurrency running, its KV resident)."""
    given = engine_kwargs(args)
    running = given.setdefault("max_running_requests", max_concurrency)
    context = args.input_len + args.output_len + 16
    given.setdefault("max_context_len", context)
    if "kv_cache_memory_gb" not in given:
        given.setdefault("kv_cache_tokens", running * (context + given.get("page_size", 16)) + 64)
    return given


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .batch import model_folder, random_prompts, vocab_size

    levels = [int(c) for c in args.concurrency.split(",")]
    n, n_in, n_out = args.num_prompts, args.input_len, args.output_len
    with tempfile.TemporaryDirectory() as tmp:
        folder, load_format = model_folder(args, tmp)
        engine_args = {"load_format": load_format, **workload_engine_args(args, max(levels))}
        vocab = vocab_size(folder)
        apis = APIS[args.api]  # a fresh prompt set per level and API: no prefix-cache hits across them
        prompt_sets = {(k, api): random_prompts(vocab, n, n_in, seed=k * len(apis) + j).tolist()
                       for k in range(len(levels)) for j, api in enumerate(apis)}
        single = random_prompts(vocab, 1, n_in, seed=len(prompt_sets)).tolist()[0]
        from .offline_ref import measure_in_child

        warm = random_prompts(vocab, 8, n_in, seed=99).tolist()  # first-use costs stay out of every timing
        offline = measure_in_child(str(folder), engine_args, prompt_sets[0, apis[0]], n_out, single, warm, args.threads)
        env = {"OMP_NUM_THREADS": str(args.threads)}  # the offline run's torch threads, in every server process
        rows = []
        for target in TARGETS[args.target]:
            with server(target, str(folder), engine_args, max(levels) + 64, env, "http" in apis) as front:
                run_clients(front.grpc, [(f"warm{i}", p) for i, p in enumerate(warm)], 4, len(warm), args.processes)
                for k, c in enumerate(levels):
                    count = min(n, max(args.waves * c, 4))  # a level runs that many waves of requests
                    for api in apis:
                        jobs = [(f"{target}-{api}-c{c}-{i}", p) for i, p in enumerate(prompt_sets[k, api][:count])]
                        at = front.http if api == "http" else front.grpc
                        assert at is not None
                        results = run_clients(at, jobs, n_out, c, args.processes, args.channels, args.timeout, api)
                        rows.append(_row(target, api, c, summarize(results, n_out), offline))
    top = [r for r in rows if r["concurrency"] == max(levels) and r["api"] == apis[0]]
    return {"bench": "serving", "model": args.model or f"random:{args.shape}",
            "device": engine_args.get("device", "cpu"), "num_prompts": n, "input_len": n_in, "output_len": n_out,
            "concurrency": levels, "torch_threads": args.threads, "client_processes": args.processes, "channels_per_process": args.channels,
            "engine_args": engine_args, "offline": offline, "results": rows,
            "serving_vs_offline_at_max_concurrency": {r["target"]: r["vs_offline_output_tok_s"] for r in top},
            "itl_p50_vs_decode_step_at_concurrency_1": {f"{r['target']}/{r['api']}": r["itl_p50_vs_offline_decode_step"]
                                                        for r in rows if "itl_p50_vs_offline_decode_step" in r},
            "http_vs_grpc_output_tok_s": _http_vs_grpc(rows)}


def _row(target: str, api: str, c: int, summary: dict[str, Any], offline: dict[str, Any]) -> dict[str, Any]:
    row = {"target": target, "api": api, "concurrency": c, **summary}
    row["vs_offline_output_tok_s"] = round(row["output_tokens_per_s"] / offline["output_tokens_per_s"], 3)
    if c == 1 and row["itl_ms_p50"] is not None:
        row["itl_p50_vs_offline_decode_step"] = round(row["itl_ms_p50"] / offline["decode_step_ms_batch1"], 3)
    return row


def _http_vs_grpc(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per target and concurrency: HTTP's output tok/s over gRPC's (the same server, prompts and run)."""
    grpc = {(r["target"], r["concurrency"]): r["output_tokens_per_s"] for r in rows if r["api"] == "grpc"}
    return {f"{r['target']}/c{r['concurrency']}": round(r["output_tokens_per_s"] / grpc[r["target"], r["concurrency"]], 3)
            for r in rows if r["api"] == "http" and grpc.get((r["target"], r["concurrency"]))}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder (default: random weights of --shape)")
    p.add_argument("--shape", default="tiny", help="preset (tiny, llama-3.1-8b, ...) or a config.json path")
    p.add_argument("--target", choices=sorted(TARGETS), default="both",
                   help="serve: one process; router: modeserve router + one modeserve engine; both")
    p.add_argument("--api", choices=sorted(APIS), default="grpc",
                   help="grpc: Generate streams; http: /v1/completions SSE streams; both: each on the same server")
    p.add_argument("--concurrency", default="1,64,512", help="requests in flight (closed loop), one run each")
    p.add_argument("--num-prompts", type=int, default=512, help="requests at most per concurrency level (and offline)")
    p.add_argument("--waves", type=int, default=2, help="a level runs waves x concurrency requests (at least 4)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=512, help="new tokens per request (ignore_eos, greedy)")
    p.add_argument("--processes", type=int, default=4, help="client processes")
    p.add_argument("--channels", type=int, default=1, help="grpc.aio channels per client process")
    p.add_argument("--timeout", type=float, default=3600.0, help="deadline of each request, seconds")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of each server process and the offline "
                                                          "run (1 leaves cores to the router and the clients)")
    add_engine_args(p)  # passed to the server processes and the offline run alike
