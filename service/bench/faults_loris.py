"""Slow-loris clients: many ``Generate`` streams (long outputs, top-20 logprobs a token: large
messages) opened and never read, over channels with small HTTP/2 receive windows, so that the
server's writes stall; meanwhile normal streams must come out exact, their latency next to a
baseline without the loris measured in the same run, and the router's and engine's memory bounded."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

from .faults_cluster import Cluster
from .faults_tally import Sent, Workload, memory, send, send_async, tally
from .serving import summarize

if TYPE_CHECKING:
    from .faults import FaultsConfig

# no BDP probing and a small lookahead: a stream's window stays near HTTP/2's 64 KiB default
STALLING_CHANNEL = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0),
                    ("grpc.http2.lookahead_bytes", 1024)]


@contextlib.asynccontextmanager
async def held_streams(address: str, num_streams: int, max_new_tokens: int, prompt: list[int],
                       num_channels: int = 4) -> AsyncIterator[int]:
    """Open the streams on the running event loop and yield how many a router serves (their first
    message's headers came and they were not refused); they are never read, and are cancelled on exit."""
    import grpc

    from ...proto.v1 import generate_pb2, generate_pb2_grpc

    channels = [grpc.aio.insecure_channel(address, options=STALLING_CHANNEL) for _ in range(num_channels)]
    stubs = [generate_pb2_grpc.GenerateStub(c) for c in channels]
    sampling = generate_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True,
                                           logprobs=20)
    calls = [stubs[i % num_channels].Generate(generate_pb2.GenerateRequest(
        request_id=f"loris-{i}", token_ids=prompt, sampling=sampling)) for i in range(num_streams)]

    async def serving(call: Any) -> bool:
        await call.initial_metadata()
        return not call.done() or await call.code() == grpc.StatusCode.OK

    try:
        checks = [asyncio.ensure_future(serving(c)) for c in calls]
        done, _ = await asyncio.wait(checks, timeout=120)
        yield sum(not t.cancelled() and t.exception() is None and t.result() for t in done)
    finally:
        for c in calls:
            c.cancel()
        await asyncio.gather(*(c.close() for c in channels))


class PeakSampler:
    """A thread reading the cluster's resident memory every ``interval`` seconds; ``stop`` returns
    the peak of each role."""

    def __init__(self, cluster: Cluster, interval: float = 0.25) -> None:
        self.cluster, self.interval = cluster, interval
        self.peak = cluster.rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = self.cluster.rss_mib()
            self.peak = {role: max(mib, self.peak[role]) for role, mib in now.items()}

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peak


def _latency(sent: list[Sent], new_tokens: int) -> dict[str, Any]:
    s = summarize([r for r, _ in sent], new_tokens)
    return {k: s[k] for k in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "output_tokens_per_s")}


async def _beside_loris(cfg: FaultsConfig, cluster: Cluster, work: Workload
                        ) -> tuple[int, list[Sent], dict[str, float]]:
    """Normal streams while the loris streams are held, on one event loop: (loris streams served,
    the normal streams, the peak resident memory while they were held)."""
    address = cluster.router.address
    async with held_streams(address, cfg.loris_streams, cfg.loris_new_tokens, work.prompts[0]) as opened:
        sampler = PeakSampler(cluster)
        under = await send_async(address, work, "normal", cfg.seconds * 2 / 3)
        peak = sampler.stop()
    return opened, under, peak


def slow_loris(cfg: FaultsConfig, cluster: Cluster, work: Workload) -> dict[str, Any]:
    baseline = send(cluster.router.address, work, "base", cfg.seconds / 3)
    start = cluster.rss_mib()
    opened, under, peak = asyncio.run(_beside_loris(cfg, cluster, work))
    time.sleep(1.0)  # the router and engine let the cancelled streams go before the last reading
    end = cluster.rss_mib()
    base = tally(baseline)
    return {**tally(under).summary(), "loris_streams": cfg.loris_streams, "loris_streams_opened": opened,
            "loris_max_new_tokens": cfg.loris_new_tokens, "latency_under_loris": _latency(under, work.new_tokens),
            "baseline": {"requests_sent": base.sent, "completed_exact": base.completed_exact,
                         **_latency(baseline, work.new_tokens)},
            "memory": memory(start, end, peak),
            "router_mib_per_loris_stream": round((peak["router"] - start["router"]) / cfg.loris_streams, 3),
            "memory_note": "start: before the loris streams open; peak: while they are held; end: after they close"}
