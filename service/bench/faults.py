"""``modeserve bench faults``: the service under faults, on CPU, with real ``modeserve router`` and
``modeserve engine`` processes on loopback, driven by asyncio gRPC clients in this process, each
scenario bounded in time. Every stream is greedy and judged token by token against ``LLM.generate``
on the same model: completed exact, refused with a clear status, lost, or diverged (its tokens past
the divergence counted as duplicated). Scenarios: ``kill`` (SIGKILL a random engine every few
seconds under load, restart it, the rank rejoins), ``kv`` (a KV pool far smaller than the load:
preemption, queue-full and never-fits refusals), ``restart`` (SIGKILL the router while streams run,
start a new one over the same engines) and ``loris`` (streams that are never read)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ...engine import LLM, SamplingParams
from ...engine.models.random_checkpoint import write_random_checkpoint
from .batch import vocab_size
from .faults_cluster import Cluster
from .faults_loris import slow_loris
from .faults_scenarios import engine_kill_storm, kv_cluster, kv_exhaustion_storm, router_restart, shared_cluster
from .faults_tally import Reference, Workload, send
from .load_client import short_prompts

SCENARIOS = ("kill", "kv", "restart", "loris")
NAMES = {"kill": "engine_kill_storm", "kv": "kv_exhaustion_storm", "restart": "router_restart", "loris": "slow_loris"}


@dataclasses.dataclass(frozen=True)
class FaultsConfig:
    model: str  # an HF folder, served by every engine and the reference alike
    scenarios: tuple[str, ...] = SCENARIOS
    seconds: float = 35.0  # of load per scenario (process start-up aside)
    engines: int = 3  # of the kill storm
    kill_interval: float = 4.0
    concurrency: int = 12
    new_tokens: int = 48
    kv_cache_tokens: int = 512
    kv_concurrency: int = 24
    kv_max_queued: int = 14
    kv_new_tokens: int = 64
    loris_streams: int = 64
    loris_new_tokens: int = 1024
    loris_concurrency: int = 4
    threads: int = 1
    page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.scenarios) - set(SCENARIOS)
        if unknown or not self.scenarios:
            raise ValueError(f"--scenarios: choose from {','.join(SCENARIOS)}, got {','.join(self.scenarios)}")
        if self.engines < 2:
            raise ValueError(f"--engines must be >= 2 (one stays up while another restarts), got {self.engines}")
        if self.seconds <= 0 or self.kill_interval <= 0:
            raise ValueError("--seconds-per-scenario and --kill-interval must be > 0")
        counts = {"--concurrency": self.concurrency, "--new-tokens": self.new_tokens,
                  "--kv-concurrency": self.kv_concurrency, "--kv-max-queued": self.kv_max_queued,
                  "--kv-new-tokens": self.kv_new_tokens, "--loris-streams": self.loris_streams,
                  "--loris-new-tokens": self.loris_new_tokens, "--loris-concurrency": self.loris_concurrency,
                  "--threads": self.threads}
        bad = [f"{k} must be >= 1, got {v}" for k, v in counts.items() if v < 1]
        if bad:
            raise ValueError("; ".join(bad))
        if self.kv_capacity < 2 * (16 + self.kv_new_tokens):
            raise ValueError(f"--kv-cache-tokens {self.kv_cache_tokens} is too small for prompts of 16 tokens and "
                             f"--kv-new-tokens {self.kv_new_tokens}")

    @property
    def kv_capacity(self) -> int:
        """KV slots a request may hold in the KV storm's pool (its first page is reserved)."""
        return self.kv_cache_tokens - self.page_size

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": str(self.threads)}


def kv_prompts(cfg: FaultsConfig, vocab: int, count: int = 48) -> list[list[int]]:
    """Prompts from 16 tokens up to what leaves room for half the outputs beside them (several fit the
    pool, not all at once); every 8th longer than the pool can ever hold with its output."""
    rng = random.Random(cfg.seed)
    top = max(16, cfg.kv_capacity // 2 - cfg.kv_new_tokens)
    lengths = [cfg.kv_capacity - cfg.kv_new_tokens // 2 if i % 8 == 7 else rng.randint(16, top) for i in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def references(llm: LLM, prompts: list[list[int]], new_tokens: int, capacity: int | None = None) -> list[Reference]:
    """Greedy ``LLM.generate`` outputs of ``prompts``; None for one whose prompt and output exceed
    ``capacity`` KV slots (it must be refused)."""
    fits = [capacity is None or len(p) + new_tokens <= capacity for p in prompts]
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    outs = iter(llm.generate(prompt_token_ids=[p for p, ok in zip(prompts, fits) if ok], sampling_params=sp))
    return [next(outs).token_ids if ok else None for ok in fits]


def workloads(cfg: FaultsConfig, vocab: int) -> dict[str, Workload]:
    context = int(json.loads((Path(cfg.model) / "config.json").read_text())["max_position_embeddings"])
    if "kv" in cfg.scenarios and cfg.kv_cache_tokens > context:
        raise ValueError(f"--kv-cache-tokens {cfg.kv_cache_tokens} is over the model's context ({context}): the KV "
                         f"storm's pool must be what limits a request")
    if "loris" in cfg.scenarios and cfg.loris_new_tokens + 16 >= context:
        raise ValueError(f"--loris-new-tokens {cfg.loris_new_tokens} and a prompt exceed the model's context ({context})")
    llm = LLM(model=cfg.model, page_size=cfg.page_size, kv_cache_tokens=1 << 15)
    short = short_prompts(64, vocab, seed=cfg.seed)
    long_ = kv_prompts(cfg, vocab)
    refs = references(llm, short, cfg.new_tokens)
    kv_refs = references(llm, long_, cfg.kv_new_tokens, cfg.kv_capacity) if "kv" in cfg.scenarios else []
    return {"kill": Workload(short, refs, cfg.new_tokens, cfg.concurrency),
            "restart": Workload(short, refs, cfg.new_tokens, cfg.concurrency),
            "kv": Workload(long_, kv_refs, cfg.kv_new_tokens, cfg.kv_concurrency),
            "loris": Workload(short, refs, cfg.new_tokens, cfg.loris_concurrency)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    on_shared: dict[str, Callable[[FaultsConfig, Cluster, Workload], dict[str, Any]]] = {
        "kill": engine_kill_storm, "restart": router_restart, "loris": slow_loris}  # in this order
    began = time.monotonic()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = args.model or str(write_random_checkpoint(Path(tmp) / "model", args.shape))
        cfg = config(args, model)
        work = workloads(cfg, vocab_size(model))
        shared = [s for s in on_shared if s in cfg.scenarios]
        clusters = {**({"shared": shared_cluster(cfg, [work[s] for s in shared])} if shared else {}),
                    **({"kv": kv_cluster(cfg, work["kv"])} if "kv" in cfg.scenarios else {})}
        for c in clusters.values():
            stack.callback(c.close)
        with ThreadPoolExecutor(len(clusters)) as pool:  # all start at once
            list(pool.map(Cluster.start, clusters.values()))
        if shared:
            cluster = clusters["shared"]
            send(cluster.router.address, work[shared[0]], "warm", count=8)  # first-use costs stay out
            for s in shared:
                results[NAMES[s]] = _timed(on_shared[s], cfg, cluster, work[s])
        if "kv" in cfg.scenarios:
            results[NAMES["kv"]] = _timed(kv_exhaustion_storm, cfg, clusters["kv"], work["kv"])
    return {"bench": "faults", "model": args.model or f"random:{args.shape}", "cpu_cores": os.cpu_count(),
            "seconds_per_scenario": cfg.seconds, "scenarios": results, "seconds": round(time.monotonic() - began, 1)}


def _timed(scenario: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    began = time.monotonic()
    out = scenario(*args)
    return {**out, "seconds": round(time.monotonic() - began, 1)}


def config(args: argparse.Namespace, model: str) -> FaultsConfig:
    """The flags of ``add_arguments``, by their fields' names (``--seconds-per-scenario``: ``seconds``)."""
    named = {f.name: getattr(args, f.name) for f in dataclasses.fields(FaultsConfig)
             if f.name not in ("model", "scenarios", "seconds") and hasattr(args, f.name)}
    return FaultsConfig(model=model, scenarios=tuple(s for s in args.scenarios.split(",") if s),
                        seconds=args.seconds_per_scenario, **named)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = FaultsConfig(model="")
    p.add_argument("--model", default=None, help="HF folder (default: random weights of --shape)")
    p.add_argument("--shape", default="tiny", help="random-weight shape when no --model")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of " + ",".join(SCENARIOS))
    p.add_argument("--seconds-per-scenario", type=float, default=d.seconds, help="load time of each scenario")
    p.add_argument("--engines", type=int, default=d.engines, help="engine processes (kill storm, router restart, loris)")
    p.add_argument("--kill-interval", type=float, default=d.kill_interval,
                   help="seconds between SIGKILLs (none while only one engine is READY)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="streams in flight (kill, restart)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="greedy tokens per normal stream")
    p.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens, help="the KV storm's pool")
    p.add_argument("--kv-concurrency", type=int, default=d.kv_concurrency, help="streams in flight (kv)")
    p.add_argument("--kv-max-queued", type=int, default=d.kv_max_queued,
                   help="the KV storm router's --max-queued-requests (past it: RESOURCE_EXHAUSTED)")
    p.add_argument("--kv-new-tokens", type=int, default=d.kv_new_tokens)
    p.add_argument("--loris-streams", type=int, default=d.loris_streams, help="streams opened and never read")
    p.add_argument("--loris-new-tokens", type=int, default=d.loris_new_tokens)
    p.add_argument("--loris-concurrency", type=int, default=d.loris_concurrency,
                   help="normal streams in flight beside the loris")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads of each server process")
    p.add_argument("--seed", type=int, default=d.seed, help="which engine is killed when; the KV storm's prompts")
