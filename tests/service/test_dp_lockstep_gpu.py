"""Lockstep DP on a GPU: one rank decodes through a CUDA graph while the other has no work; the idle
rank replays the same bucket with padding only, and nothing deadlocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeserve.engine.config import EngineConfig, SchedulerConfig
from modeserve.engine.models.loader import open_checkpoint
from modeserve.engine.runner.model_runner import ModelRunner
from modeserve.service.rpc.client import GenerateClient
from modeserve.service.rpc.engine_server import create_engine_server
from modeserve.service.router.remote import RemoteRouterConfig, start_remote_router
from tests.engine.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu


def test_graph_decode_beside_an_idle_rank(tmp_path: Path) -> None:
    folder = make_tiny_model("llama3", tmp_path / "m", head_dim=64)
    cfg = EngineConfig.from_kwargs(model=str(folder), device="cuda", dtype="bfloat16", page_size=16,
                                   kv_cache_tokens=4096, max_running_requests=16)
    runners = [ModelRunner(cfg.runner, open_checkpoint(folder)) for _ in range(2)]
    assert all(r.graphs is not None for r in runners)
    servers = [create_engine_server(r, "127.0.0.1:0", model_path=str(folder), dp_rank=i) for i, r in enumerate(runners)]
    app = start_remote_router("127.0.0.1:0", [f"127.0.0.1:{s.port}" for s in servers], None,
                              RemoteRouterConfig(SchedulerConfig(), dispatch="round-robin", lockstep=True))
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        out = client.generate(token_ids=[3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=16, ignore_eos=True,
                              timeout=300)  # the first prefill may JIT-compile FlashInfer kernels (~75 s)
        assert len(out.token_ids) == 16
        hits = [r.graphs.stats()["hits"] for r in runners if r.graphs is not None]
        busy, idle = (0, 1) if hits[0].get("DECODE") else (1, 0)
        assert hits[busy].get("DECODE", 0) >= 15
        assert hits[idle].get("IDLE", 0) >= 15 and not hits[idle].get("DECODE")
    finally:
        client.close()
        app.stop(grace=1)
        for s in servers:
            s.stop(1)
