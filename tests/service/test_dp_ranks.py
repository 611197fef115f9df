"""DP ranks over real engine processes on loopback: dispatch by cached prefix, failover after a
SIGKILL, draining, ranks added at run time, lockstep with IDLE steps."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest

from modeserve.engine.config import SchedulerConfig
from modeserve.proto.v1 import admin_pb2, admin_pb2_grpc
from modeserve.service.rpc.client import Completion, GenerateClient
from modeserve.service.cli.drain import drain
from modeserve.service.router.rank_table import RankSpec
from modeserve.service.router.app import RouterApp
from modeserve.service.router.remote import RemoteRouterConfig, start_remote_router
from tests.engine.tiny_models import COMMON, mixed_prompts
from tests.service.test_router_remote import spawn
from tests.service.test_serve import generate_all, reference
from tests.service.test_tls import pki

SCHED = SchedulerConfig(chunked_prefill_size=32, enable_mixed=True, max_prefill_ratio=0.5)


def start_engines(model: Path, n: int, *extra: str) -> list[tuple[subprocess.Popen[str], str]]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda r: spawn("engine", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                                             "--page-size", "4", "--kv-cache-tokens", "4096", "--dp-rank", str(r),
                                             *extra),
                             range(n)))


def stop_engines(procs: list[tuple[subprocess.Popen[str], str]]) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _ in procs:
        proc.wait(timeout=30)


@pytest.fixture
def router_over(tiny_model: Path) -> Iterator[Callable[..., tuple[RouterApp, GenerateClient, list]]]:
    made: list[tuple[RouterApp, GenerateClient, list]] = []

    def make(n: int, sched: SchedulerConfig = SCHED, engine_args: tuple[str, ...] = (),
             **kw: object) -> tuple[RouterApp, GenerateClient, list]:
        procs = start_engines(tiny_model, n, *engine_args)
        app = start_remote_router("127.0.0.1:0", [a for _, a in procs], None,
                                  RemoteRouterConfig(sched, **kw))  # type: ignore[arg-type]
        client = GenerateClient(f"127.0.0.1:{app.port}")
        made.append((app, client, procs))
        return app, client, procs

    yield make
    for app, client, procs in made:
        client.close()
        app.stop(grace=1)
        stop_engines(procs)


def admin(app: RouterApp) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{app.port}"))


def decode_steps(app: RouterApp) -> list[int]:
    return [lp.scheduler.stats.get_stats()["mode_distribution"].get("DECODE", 0) for lp in app.loops]


def test_three_ranks_48_streams_and_prefix_dispatch(router_over: Callable, tiny_model: Path) -> None:
    app, client, _ = router_over(3)
    prompts = mixed_prompts(48, COMMON["vocab_size"], seed=21, max_len=40)
    outs = generate_all(client, prompts, 8)
    assert [o.token_ids for o in outs] == reference(tiny_model, prompts, 8)
    assert all(d > 0 for d in decode_steps(app))  # every rank took work
    # a long shared prefix: once one rank has cached it, the requests that share it go there
    prefix = [(5 * i + 7) % COMMON["vocab_size"] for i in range(48)]
    client.generate(token_ids=prefix + [1], max_new_tokens=2, ignore_eos=True)
    before = [s.prefix_hit_tokens for s in app.table.status()]
    followers = [prefix + [2 + i, 3 + i] for i in range(6)]
    for p in followers:
        client.generate(token_ids=p, max_new_tokens=2, ignore_eos=True)
    gained = [s.prefix_hit_tokens - b for s, b in zip(app.table.status(), before)]
    assert sorted(gained)[:2] == [0, 0] and max(gained) >= 6 * 48  # all hits on one rank


def child_pids(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("variant", [None, "ngram", "draft", "mutual-tls", "split", "tensor-parallel"])
def test_sigkill_one_engine_loses_nothing(router_over: Callable, tiny_model: Path, variant: str | None,
                                          tmp_path: Path) -> None:
    """With n-gram drafts, with a draft model in each engine, with mutual TLS between router and
    engines, with split prefill (the moved requests' prompts and tokens recomputed a slice of
    layers a step beside the survivors' decodes), and with two tensor-parallel ranks an engine, the
    one killed being an engine's rank 1 (which takes its engine out), too: a request moved to another
    rank mid-run keeps what was delivered (its accepted runs included) and goes on without a gap or a repeat."""
    speculative = variant if variant in ("ngram", "draft") else None
    sched = dataclasses.replace(SCHED, speculative_algorithm=speculative)
    if variant == "split":
        sched = dataclasses.replace(sched, enable_split_prefill=True, split_prefill_min_tokens=16,
                                    split_prefill_token_budget=16)
    engine_args: tuple[str, ...] = (("--speculative-algorithm", "draft", "--speculative-draft-model", str(tiny_model))
                                    if speculative == "draft" else ())
    tls: dict[str, object] = {}
    if variant == "mutual-tls":
        keys = pki(tmp_path / "pki", "dp")
        engine_args = ("--tls-cert", str(keys.server.cert), "--tls-key", str(keys.server.key), "--tls-ca", keys.ca_file)
        tls = {"engine_tls": keys.client}
    if variant == "tensor-parallel":
        engine_args = ("--tensor-parallel-size", "2")
    app, client, procs = router_over(3, sched=sched, engine_args=engine_args, dispatch="round-robin", **tls)
    prompts = mixed_prompts(24, COMMON["vocab_size"], seed=22, max_len=30)
    if speculative:
        prompts = [p * 2 for p in prompts]  # repeats: prompt lookup finds drafts
    max_new = 120
    expect = reference(tiny_model, prompts, max_new)
    started = threading.Event()
    outs: list[Completion | None] = [None] * len(prompts)

    def run(i: int) -> None:
        out = Completion()
        for msg in client.stream(token_ids=prompts[i], max_new_tokens=max_new, ignore_eos=True):
            out.token_ids.extend(msg.token_ids)
            if len(out.token_ids) >= 5:
                started.set()
            if msg.finish_reason:
                out.finish_reason = msg.finish_reason
        outs[i] = out

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    assert started.wait(30)
    victim = procs[1][0]
    if variant == "tensor-parallel":
        (rank1,) = child_pids(victim.pid)
        os.kill(rank1, signal.SIGKILL)
    else:
        victim.kill()
    for t in threads:
        t.join(timeout=120)
    assert victim.wait(timeout=10) == (70 if variant == "tensor-parallel" else -signal.SIGKILL)
    assert all(o is not None and o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs if o is not None] == expect  # none lost, none duplicated
    if speculative:
        assert sum(lp.scheduler.stats.spec_accepted_tokens for lp in app.loops) > 0
    if variant == "split":
        assert sum(lp.scheduler.stats.mode_counts["SPLIT_PREFILL"] for lp in app.loops) > 0
    states = {s.rank: s.state for s in app.table.status()}
    assert states[1] == admin_pb2.RANK_STATE_GONE and states[0] == states[2] == admin_pb2.RANK_STATE_READY
    assert app.table.ranks()[1].loop is not None and app.table.ranks()[1].loop.error
    # the engine comes back (a restarted pod at the same address): offered again, the rank rejoins
    port = procs[1][1].rsplit(":", 1)[1]
    revived = spawn("engine", "--model", str(tiny_model), "--host", "127.0.0.1", "--port", port, "--page-size", "4",
                    "--kv-cache-tokens", "4096", "--dp-rank", "1", *engine_args)
    procs.append(revived)
    app.table.set_ranks([RankSpec(i, a) for i, (_, a) in enumerate(procs[:3])])
    deadline = time.time() + 30
    while app.table.status()[1].state != admin_pb2.RANK_STATE_READY:
        assert time.time() < deadline
        time.sleep(0.05)


def test_drain_finishes_running_then_reports_drained(router_over: Callable, tiny_model: Path) -> None:
    app, client, procs = router_over(2, dispatch="round-robin")
    stub = admin(app)
    prompts = mixed_prompts(8, COMMON["vocab_size"], seed=23, max_len=30)
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(client.generate, token_ids=p, max_new_tokens=150, ignore_eos=True) for p in prompts]
        time.sleep(0.3)
        assert app.loops[1].num_requests > 0
        status = stub.SetRanks(admin_pb2.SetRanksRequest(ranks=[
            admin_pb2.RankSpec(rank=0, address=procs[0][1]), admin_pb2.RankSpec(rank=1, address=procs[1][1], draining=True)]))
        assert status.ranks[1].state == admin_pb2.RANK_STATE_DRAINING
        later = mixed_prompts(6, COMMON["vocab_size"], seed=24, max_len=20)
        rank1_before = app.loops[1].scheduler.stats.get_stats()["requests_by_mode"].get("EXTEND", 0)
        new_outs = generate_all(client, later, 4)
        assert app.loops[1].scheduler.stats.get_stats()["requests_by_mode"].get("EXTEND", 0) == rank1_before
        outs = [f.result(timeout=60) for f in running]
    assert [o.token_ids for o in outs] == reference(tiny_model, prompts, 150)  # finished where they ran
    assert [o.token_ids for o in new_outs] == reference(tiny_model, later, 4)
    final = stub.GetRanks(admin_pb2.GetRanksRequest())
    assert [r.state for r in final.ranks] == [admin_pb2.RANK_STATE_READY, admin_pb2.RANK_STATE_DRAINED]
    # the router closes its stream to the drained rank: the engine's own drain (its pod's preStop) completes
    assert drain(procs[1][1], timeout=10)
    assert not drain(procs[0][1], timeout=1)  # the ready rank still has the router's stream


def test_rank_added_at_run_time_takes_traffic(router_over: Callable, tiny_model: Path) -> None:
    app, client, procs = router_over(1, dispatch="round-robin")
    (extra, address), = start_engines(tiny_model, 1)
    try:
        stub = admin(app)
        stub.SetRanks(admin_pb2.SetRanksRequest(ranks=[admin_pb2.RankSpec(rank=0, address=procs[0][1]),
                                                       admin_pb2.RankSpec(rank=1, address=address)]))
        deadline = time.time() + 60
        while [s.state for s in app.table.status()] != [admin_pb2.RANK_STATE_READY, admin_pb2.RANK_STATE_READY]:
            assert time.time() < deadline
            time.sleep(0.05)
        prompts = mixed_prompts(8, COMMON["vocab_size"], seed=25, max_len=20)
        assert [o.token_ids for o in generate_all(client, prompts, 4)] == reference(tiny_model, prompts, 4)
        assert all(d > 0 for d in decode_steps(app))
        assert client.model_info().num_ranks == 2
    finally:
        stop_engines([(extra, address)])


def test_lockstep_idle_rank_steps_with_the_busy_one(router_over: Callable, tiny_model: Path) -> None:
    app, client, _ = router_over(2, dispatch="round-robin", lockstep=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = client.generate(token_ids=prompt, max_new_tokens=12, ignore_eos=True)
    assert out.token_ids == reference(tiny_model, [prompt], 12)[0]
    stats = [lp.scheduler.stats.get_stats()["mode_distribution"] for lp in app.loops]
    busy, idle = (0, 1) if stats[0].get("DECODE", 0) else (1, 0)
    assert stats[busy].get("DECODE", 0) >= 11 and stats[busy].get("IDLE", 0) == 0
    # the other rank ran an IDLE batch in each of those steps, and nothing else
    steps = stats[busy].get("DECODE", 0) + stats[busy].get("EXTEND", 0) + stats[busy].get("MIXED", 0)
    assert stats[idle].get("IDLE", 0) == steps and set(stats[idle]) == {"IDLE"}
