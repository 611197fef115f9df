"""Clients that never read their streams cost the router a bounded amount: past ``--max-unsent-tokens``
(tokens generated and not yet taken, all streams together) the stream holding most is cancelled and
its request aborted; streams that are read alongside complete exactly, and the pool returns to idle."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from modeserve.engine import LLM, SamplingParams
from modeserve.service.bench.faults_loris import held_streams
from modeserve.service.router.backlog import Backlog
from modeserve.service.router.in_process import start_serve
from modeserve.service.router.request_handle import TokenUpdate
from modeserve.service.rpc.client import GenerateClient
from modeserve.service.rpc.grpc_server import ServerOptions
from tests.service.test_serve import wait_idle


def test_backlog_cancels_the_stream_holding_most() -> None:
    async def run() -> tuple[bool, bool, int, int]:
        backlog = Backlog(10)
        small, big = backlog.open(None), backlog.open(None)
        victim = asyncio.ensure_future(asyncio.sleep(60))
        spared = asyncio.ensure_future(asyncio.sleep(60))
        small.task, big.task = spared, victim
        small.put_nowait(TokenUpdate((1, 2, 3)))
        big.put_nowait(TokenUpdate((1,) * 6))
        big.taken(big.get_nowait())  # read: no longer held
        big.put_nowait(TokenUpdate((1,) * 7))
        assert backlog.total == 10 and not victim.cancelled()
        big.put_nowait(TokenUpdate((1,)))  # 11 > 10: the 8-token stream goes, not the 3-token one
        await asyncio.sleep(0)
        result = (victim.cancelled(), spared.cancelled(), backlog.total, backlog.cancelled)
        spared.cancel()
        return result

    assert asyncio.run(run()) == (True, False, 3, 1)


def test_unread_streams_are_cancelled_and_read_ones_complete(tiny_model: Path) -> None:
    """Eight streams of 200 tokens with 20 logprobs each, over channels with small HTTP/2 windows, never
    read (``bench faults``' slow-loris clients): the router cancels streams until what it holds for
    them is within the bound; a stream read meanwhile is exact; afterwards the pool is idle."""
    app = start_serve("127.0.0.1:0", str(tiny_model), page_size=4, kv_cache_tokens=8192,
                      options=ServerOptions(max_unsent_tokens=300))
    target = f"127.0.0.1:{app.port}"
    backlog = app.servicer.generation.backlog

    def read_one() -> list[int]:
        client = GenerateClient(target)
        try:
            return client.generate(token_ids=[8, 9, 10], max_new_tokens=24, ignore_eos=True).token_ids
        finally:
            client.close()

    async def run() -> list[int]:
        async with held_streams(target, 8, 200, [5, 6, 7]):
            deadline = time.monotonic() + 60
            while backlog.cancelled == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return await asyncio.get_running_loop().run_in_executor(None, read_one)

    try:
        got = asyncio.run(run())
        assert backlog.cancelled > 0 and backlog.total <= 300
        ref = LLM(model=str(tiny_model), page_size=4).generate(
            prompt_token_ids=[[8, 9, 10]], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=24,
                                                                          ignore_eos=True))[0]
        assert got == ref.token_ids
        wait_idle(app)
        # the streams the clients closed end on the router's event loop, after their requests left the pool
        deadline = time.monotonic() + 10
        while backlog.total and time.monotonic() < deadline:
            time.sleep(0.02)
        assert backlog.total == 0
    finally:
        app.stop(grace=1)
