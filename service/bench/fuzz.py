"""``modeserve bench fuzz``: the fuzz tests' generators (``fuzz_cases``), for longer, against a
``modeserve engine`` process and a ``modeserve router`` process (with its HTTP API) over it, on loopback.

Two phases, because ``Engine.Forward`` trusts its caller with every KV slot (issue 27: mutual TLS and
the NetworkPolicy keep other callers off the engine port), so a batch that passes validation may
overwrite the KV of any request the engine holds:

1. the router's surfaces: ``GenerateRequest``s, HTTP bodies, bytes and garbage messages on its gRPC port,
   with greedy streams through the router alongside the whole time; then the router must be idle;
2. the engine's surfaces: bytes and garbage messages on its port (greedy streams of a scheduler of our
   own on the engine alongside), then random and mutated ``ForwardBatch``es; after them a new
   stream must still be exact.

Each kind gets an equal share of ``--seconds`` (and at most ``--cases`` cases). Reported per kind: cases
tried, served (ok), refused (INVALID_ARGUMENT / 4xx), other (the goal is 0) and the statuses; per
process: alive at the end (a crash otherwise) and RSS growth over the run.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypeVar

import grpc
from prometheus_client.parser import text_string_to_metric_families

from ...engine.config import SchedulerConfig
from ...proto.v1 import engine_pb2, engine_pb2_grpc
from ..cli.engine_args import add_engine_args, engine_kwargs
from ..rpc.engine_process import engine_flags
from ..rpc.grpc_executor import TransportError
from . import fuzz_probes as probes
from .servers import child, rss_mib

if TYPE_CHECKING:  # hypothesis comes with the test extra: imported when the bench runs, not by the CLI
    from hypothesis.strategies import SearchStrategy

T = TypeVar("T")
WITNESS_PROMPT = [5, 6, 7]
ROUND = 50  # examples per hypothesis run; each run has a seed of its own


class Budget(NamedTuple):
    seconds: float  # per kind
    max_cases: int  # per kind; 0: no limit


def fuzz_kind(strategy: SearchStrategy[T], probe: Callable[[T], probes.Reply], budget: Budget,
              base_seed: int) -> list[probes.Reply]:
    """``probe`` each case ``strategy`` draws, in hypothesis runs of ``ROUND`` examples seeded
    ``base_seed``, ``base_seed + 1``, ... until the budget is spent (after one case at least)."""
    from hypothesis import HealthCheck, Phase, given, seed, settings

    replies: list[probes.Reply] = []
    deadline = time.monotonic() + budget.seconds

    def more() -> bool:  # at least one case, however short the budget
        under_cap = not budget.max_cases or len(replies) < budget.max_cases
        return not replies or (time.monotonic() < deadline and under_cap)

    for run in itertools.count():
        if not more():
            break

        @settings(max_examples=ROUND, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @seed(base_seed + run)
        @given(strategy)
        def one(case: T) -> None:
            if more():
                replies.append(probe(case))

        one()
    return replies


def _router_idle(metrics_url: str, timeout: float = 30.0) -> bool:
    """No request queued or running and no KV page held by one, on every rank (the router's /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(metrics_url, timeout=10) as resp:
                text = resp.read().decode()
        except OSError:  # the router is gone: not idle
            return False
        names = ("modeserve_queue_requests", "modeserve_running_requests", "modeserve_kv_cache_usage_ratio")
        busy = [s.value for f in text_string_to_metric_families(text) for s in f.samples if f.name in names]
        if busy and not any(busy):
            return True
        time.sleep(0.2)
    return False


def tiny_model_with_tokenizer(folder: Path) -> Path:
    """Random weights of the ``tiny`` shape with SmolLM2's tokenizer (so that text and chat work)."""
    from ...engine.default_model import default_model_path
    from ...engine.models.random_checkpoint import preset_config, write_random_checkpoint
    from ...engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    if tokenizer is None:
        raise ValueError("the default model has no tokenizer")
    write_random_checkpoint(folder, {**preset_config("tiny"), "vocab_size": tokenizer.vocab_size})
    tokenizer.hf_tokenizer.save_pretrained(folder)
    return folder


def _greedy_reference(model: str, max_new_tokens: int, engine_args: dict[str, Any]) -> list[int]:
    """The witness prompt's tokens from ``LLM.generate`` in this process, the servers' engine arguments."""
    from ...engine import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    llm = LLM(model=model, **engine_args)
    return llm.generate(prompt_token_ids=[WITNESS_PROMPT], sampling_params=sp)[0].token_ids


def _port_kinds(port: str, address: str, channel: grpc.Channel, methods: dict[str, str], budget: Budget,
                base_seed: int) -> dict[str, list[probes.Reply]]:
    """Bytes, then garbage messages for its real methods, on one gRPC port (``port``: router or engine)."""
    from . import fuzz_cases as cases

    return {f"grpc_frames_{port}": fuzz_kind(cases.raw_streams(sorted(methods)),
                                             lambda b: probes.raw_reply(address, b), budget, base_seed),
            f"grpc_messages_{port}": fuzz_kind(cases.garbage_calls(methods),
                                               lambda c: probes.garbage_reply(channel, methods, *c), budget, base_seed)}


def _witnessed(witness: probes.Witness) -> dict[str, Any]:
    exact = witness.finish()
    return {"alongside_exact": exact, "alongside_runs": witness.runs, "alongside_failures": witness.failures[:3]}


def _router_phase(address: str, http: str, budget: Budget, base_seed: int, expect: list[int]) -> dict[str, Any]:
    from . import fuzz_cases as cases

    with grpc.insecure_channel(address) as channel:
        witness = probes.Witness(lambda: probes.generate_greedy(channel, WITNESS_PROMPT, len(expect)), expect)
        kinds = {
            "generate": fuzz_kind(cases.generate_requests, lambda r: probes.generate_reply(channel, r), budget,
                                  base_seed),
            "http": fuzz_kind(cases.http_bodies, lambda c: probes.http_reply(http, *c), budget, base_seed),
            **_port_kinds("router", address, channel, cases.ROUTER_METHODS, budget, base_seed)}
        return {"kinds": kinds, **_witnessed(witness)}


def _engine_phase(address: str, budget: Budget, base_seed: int, expect: list[int]) -> dict[str, Any]:
    from . import fuzz_batches as batches, fuzz_cases as cases

    with grpc.insecure_channel(address) as channel:
        desc = engine_pb2_grpc.EngineStub(channel).Describe(engine_pb2.DescribeRequest(), timeout=30)
        limits = probes.batch_limits(desc)
        witness = probes.Witness(lambda: probes.engine_greedy(channel, WITNESS_PROMPT, len(expect)), expect)
        kinds = _port_kinds("engine", address, channel, cases.ENGINE_METHODS, budget, base_seed)
        report = _witnessed(witness)
        valid = probes.valid_batches(channel)

        def forward(msgs: list[Any]) -> probes.Reply:
            return probes.forward_reply(channel, msgs, desc.vocab_size)

        kinds["forward_random"] = fuzz_kind((batches.random_batches(limits) | batches.shaped_batches(limits)).map(
            lambda b: [b]), forward, budget, base_seed)
        kinds["forward_mutated"] = fuzz_kind(batches.mutated_batches(valid, limits), forward, budget, base_seed)
        try:
            exact_after = probes.engine_greedy(channel, WITNESS_PROMPT, len(expect)) == expect
        except (grpc.RpcError, TransportError):  # the engine is gone (its process report says so)
            exact_after = False
    return {"kinds": kinds, **report, "exact_after_forward": exact_after}


def _process_report(proc: subprocess.Popen[str], rss_start: float) -> dict[str, Any]:
    alive = proc.poll() is None
    rss_end = rss_mib(proc.pid) if alive else 0.0
    return {"alive": alive, "rss_start_mib": round(rss_start, 1), "rss_end_mib": round(rss_end, 1),
            "rss_growth_mib": round(rss_end - rss_start, 1) if alive else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.seconds <= 0 and args.cases <= 0:
        raise ValueError("bench fuzz: give --seconds > 0 or --cases > 0")
    budget = Budget(args.seconds / 8 if args.seconds > 0 else float("inf"), args.cases)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model_with_tokenizer(Path(tmp) / "model"))
        engine_args = engine_kwargs(args)
        expect = _greedy_reference(model, args.witness_tokens, engine_args)
        with child("engine", "--model", model, "--grace-period", "5", *engine_flags(engine_args),
                   start_timeout=300) as (engine, engine_at), \
                child("router", "--engines", engine_at["grpc"], "--http-port", "0", "--metrics-port", "0",
                      "--grace-period", "5", *engine_flags(engine_args, (SchedulerConfig,)), start_timeout=300,
                      announced=["http", "metrics"]) as (router, router_at):
            engine_address, router_address = engine_at["grpc"], router_at["grpc"]
            with grpc.insecure_channel(router_address) as channel:
                probes.generate_greedy(channel, WITNESS_PROMPT, 1)  # warm up before the first RSS reading
            rss = {"engine": rss_mib(engine.pid), "router": rss_mib(router.pid)}
            front = _router_phase(router_address, f"http://{router_at['http']}", budget, args.seed, expect)
            front["router_idle_after"] = _router_idle(f"http://{router_at['metrics']}/metrics")
            back = _engine_phase(engine_address, budget, args.seed, expect)
            processes = {"engine": _process_report(engine, rss["engine"]),
                         "router": _process_report(router, rss["router"])}
    kinds = {name: probes.tally(replies) for phase in (front, back) for name, replies in phase.pop("kinds").items()}
    return {"bench": "fuzz", "model": args.model or "random:tiny", "seed": args.seed,
            "seconds": round(time.monotonic() - started, 1), "cases": sum(k["tried"] for k in kinds.values()),
            "other": sum(k["other"] for k in kinds.values()),
            "crashes": sum(not p["alive"] for p in processes.values()), "kinds": kinds,
            "router": front, "engine": back, "processes": processes}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF folder with a tokenizer (default: random weights of the tiny shape, SmolLM2's tokenizer)")
    p.add_argument("--seconds", type=float, default=120.0, help="time for all 8 kinds together, an equal share each")
    p.add_argument("--cases", type=int, default=0, help="cases per kind at most (0: as many as --seconds allows)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed of each kind's first run (then +1, ...)")
    p.add_argument("--witness-tokens", type=int, default=64, help="tokens of each greedy stream alongside")
    add_engine_args(p)
    p.set_defaults(page_size=4, kv_cache_tokens=8192, chunked_prefill_size=32, enable_mixed=True)
    p.description = ("The engine and router run with --page-size 4 --kv-cache-tokens 8192 --chunked-prefill-size 32 "
                     "--enable-mixed unless told otherwise.")
