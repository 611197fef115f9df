"""End to end, a router that follows its EngineSet: started without ``--engines`` over two
in-process engine servers on loopback, it takes its ranks from the EngineSet's status on kmock's
Kubernetes emulator, keeps the same table when the operator's SetRanks pushes it too, stops sending
to a rank marked Draining, lists again after a 410, and drops a rank left out. The emulator and the
``cluster`` fixture are in ``tests.service.engineset_cluster``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import kmock
import pytest

from modeserve.engine.config import EngineConfig, SchedulerConfig
from modeserve.engine.models.loader import open_checkpoint
from modeserve.engine.runner.model_runner import ModelRunner
from modeserve.proto.v1 import admin_pb2, admin_pb2_grpc
from modeserve.service.rpc.client import GenerateClient
from modeserve.service.rpc.engine_server import EngineServer, create_engine_server
from modeserve.service.router.remote import RemoteRouterConfig, start_remote_router
from tests.engine.tiny_models import COMMON, mixed_prompts
from tests.service.engineset_cluster import (Cluster, WatchEmulator, cluster,  # noqa: F401  (a fixture)
                                             eventually, status_entry)
from tests.service.test_serve import generate_all

pytestmark = pytest.mark.kmock(cls=WatchEmulator)


# ---- end to end: a router over in-process engines, ranks from the EngineSet ---------------------
@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[EngineServer]]:
    config = EngineConfig.from_kwargs(model=str(tiny_model), page_size=4, kv_cache_tokens=1024)
    servers = [create_engine_server(ModelRunner(config.runner, open_checkpoint(tiny_model)), "127.0.0.1:0",
                                    model_path=str(tiny_model), dp_rank=r) for r in range(2)]
    yield servers
    for srv in servers:
        srv.stop(0)


def extends(app: Any) -> dict[int, int]:
    """Requests each rank has prefilled, by rank (short prompts, no MIXED: one EXTEND each)."""
    return {r.rank: r.loop.scheduler.stats.get_stats()["requests_by_mode"].get("EXTEND", 0)
            for r in app.table.ranks() if r.loop is not None}


@pytest.mark.asyncio
async def test_router_without_engines_follows_the_engineset(cluster: Cluster, engines: list[EngineServer]) -> None:
    addresses = [f"127.0.0.1:{srv.port}" for srv in engines]
    await cluster.create([status_entry(r, "Ready", address=a) for r, a in enumerate(addresses)])
    app = await asyncio.to_thread(start_remote_router, "127.0.0.1:0", [], None,
                                  RemoteRouterConfig(SchedulerConfig(), wait=10, dispatch="round-robin",
                                                     health_interval=0.1), watch=cluster.watch())
    client = GenerateClient(f"127.0.0.1:{app.port}")

    async def generate(n: int, seed: int) -> None:
        prompts = mixed_prompts(n, COMMON["vocab_size"], seed=seed, max_len=20)
        outs = await asyncio.to_thread(generate_all, client, prompts, 4)
        assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outs)

    try:
        # both ranks from the status, READY once their engines serve; both take requests
        assert [(s.rank, s.address, s.state) for s in app.table.status()] == [
            (0, addresses[0], admin_pb2.RANK_STATE_READY), (1, addresses[1], admin_pb2.RANK_STATE_READY)]
        await generate(8, seed=31)
        assert all(n > 0 for n in extends(app).values()) and len(extends(app)) == 2
        loops = app.loops

        # the operator's SetRanks with the same table changes nothing (same streams, same states)
        stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{app.port}"))
        reply = stub.SetRanks(admin_pb2.SetRanksRequest(ranks=[admin_pb2.RankSpec(rank=r, address=a)
                                                               for r, a in enumerate(addresses)]))
        assert [r.state for r in reply.ranks] == [admin_pb2.RANK_STATE_READY] * 2
        assert app.loops == loops and all(lp.alive for lp in loops)

        # rank 1 draining: no new requests go there
        await cluster.publish([status_entry(0, "Ready", address=addresses[0]),
                               status_entry(1, "Draining", address=addresses[1])])
        await eventually(lambda: app.table.status()[1].state in (admin_pb2.RANK_STATE_DRAINING, admin_pb2.RANK_STATE_DRAINED))
        before = extends(app)
        await generate(6, seed=32)
        after = extends(app)
        assert after[1] == before[1] and after[0] == before[0] + 6

        # the watch expires (410) and is listed again; then rank 1 leaves the status and the router
        lists = len(cluster.requests(kmock.action.LIST))
        cluster.kmock.expire_watches(1)
        cluster.kmock.end_watches()
        await eventually(lambda: len(cluster.requests(kmock.action.LIST)) == lists + 1)
        await cluster.publish([status_entry(0, "Ready", address=addresses[0])])
        await eventually(lambda: [r.rank for r in app.table.ranks()] == [0])
        await generate(2, seed=33)
        assert client.model_info().num_ranks == 1
    finally:
        client.close()
        await asyncio.to_thread(app.stop, 1)
