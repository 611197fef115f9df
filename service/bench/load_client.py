"""The load benches' client: greedy streams from asyncio clients in separate processes (one client
process cannot saturate a server: it is one core), over gRPC (``Generate``, ``grpc.aio``) or the
OpenAI HTTP API (``/v1/completions`` as SSE, ``aiohttp``), a closed loop of a given concurrency; every
stream's status code, tokens and arrival times come back to the caller."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

Job = tuple[str, list[int]]  # (request id, prompt token ids)


@dataclass
class StreamResult:
    request_id: str
    code: str  # "OK" or the gRPC status code's name
    start: float  # time.monotonic() (one clock for every process on the host) when the call began
    end: float
    first: float | None = None  # when its first tokens arrived
    token_ids: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # per token after the first message: its message's gap / tokens
    finish_reason: str = ""
    details: str = ""


async def one_stream(stub: Any, job: Job, max_new_tokens: int, timeout: float | None) -> StreamResult:
    import grpc

    from ...proto.v1 import generate_pb2

    rid, prompt = job
    req = generate_pb2.GenerateRequest(request_id=rid, token_ids=prompt, sampling=generate_pb2.SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    out = StreamResult(rid, "OK", time.monotonic(), 0.0)
    last = 0.0
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            now = time.monotonic()
            if msg.token_ids:
                if out.first is None:
                    out.first = now
                else:
                    out.gaps.extend([(now - last) / len(msg.token_ids)] * len(msg.token_ids))
                last = now
                out.token_ids.extend(msg.token_ids)
            out.finish_reason = msg.finish_reason or out.finish_reason
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code().name, exc.details() or ""
    out.end = time.monotonic()
    return out


async def one_http_stream(session: Any, job: Job, max_new_tokens: int, timeout: float | None) -> StreamResult:
    """The same request over HTTP: token ids from each SSE chunk (``return_token_ids``)."""
    import json

    import aiohttp

    rid, prompt = job
    body = {"prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    out = StreamResult(rid, "OK", time.monotonic(), 0.0)
    last = 0.0
    try:
        async with session.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                out.code, out.details = f"HTTP_{resp.status}", await resp.text()
            else:
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.monotonic()
                    (choice,) = json.loads(line[6:])["choices"]
                    tokens = choice["token_ids"]
                    if tokens:
                        if out.first is None:
                            out.first = now
                        else:
                            out.gaps.extend([(now - last) / len(tokens)] * len(tokens))
                        last = now
                        out.token_ids.extend(tokens)
                    out.finish_reason = choice["finish_reason"] or out.finish_reason
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.code, out.details = type(exc).__name__, str(exc)
    out.end = time.monotonic()
    return out


async def run_streams(stubs: Sequence[Any], jobs: Sequence[Job], max_new_tokens: int, concurrency: int,
                      timeout: float | None = None, api: str = "grpc") -> list[StreamResult]:
    """Every job, at most ``concurrency`` in flight (a new one starts when one ends), round-robin over
    ``stubs`` (gRPC stubs, or HTTP sessions for ``api="http"``)."""
    pending = list(reversed(jobs))
    results: list[StreamResult] = []

    async def worker(k: int) -> None:
        n = 0
        while pending:
            stub = stubs[(k + n) % len(stubs)]
            call = one_http_stream if api == "http" else one_stream
            results.append(await call(stub, pending.pop(), max_new_tokens, timeout))
            n += 1

    await asyncio.gather(*(worker(k) for k in range(max(1, min(concurrency, len(jobs))))))
    return results


async def _http_client(target: str, jobs: list[Job], max_new_tokens: int, concurrency: int, channels: int,
                       timeout: float | None, barrier: Any) -> list[StreamResult]:
    import aiohttp

    sessions = [aiohttp.ClientSession(f"http://{target}", connector=aiohttp.TCPConnector(limit=0))
                for _ in range(channels)]
    try:
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 120)
        return await run_streams(sessions, jobs, max_new_tokens, concurrency, timeout, api="http")
    finally:
        await asyncio.gather(*(s.close() for s in sessions))


async def _client(target: str, jobs: list[Job], max_new_tokens: int, concurrency: int, channels: int,
                  timeout: float | None, barrier: Any) -> list[StreamResult]:
    import grpc

    from ...proto.v1 import generate_pb2_grpc

    # a local subchannel pool each: otherwise grpc shares one TCP connection between the channels
    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]
    try:
        await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), 60) for c in chans))
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 120)  # all processes start together
        stubs = [generate_pb2_grpc.GenerateStub(c) for c in chans]
        return await run_streams(stubs, jobs, max_new_tokens, concurrency, timeout)
    finally:
        await asyncio.gather(*(c.close() for c in chans))


def _client_process(target: str, jobs: list[Job], max_new_tokens: int, concurrency: int, channels: int,
                    timeout: float | None, barrier: Any, out: Any, api: str) -> None:
    client = _http_client if api == "http" else _client
    out.put(asyncio.run(client(target, jobs, max_new_tokens, concurrency, channels, timeout, barrier)))


def run_clients(target: str, jobs: Sequence[Job], max_new_tokens: int, concurrency: int, processes: int = 4,
                channels: int = 1, timeout: float | None = None, api: str = "grpc") -> list[StreamResult]:
    """``jobs`` split over ``processes`` client processes (each ``channels`` channels or HTTP sessions),
    ``concurrency`` in flight in all; every process starts sending when all are connected. Raises if one
    dies. ``target``: the gRPC address, or for ``api="http"`` the HTTP API's ``host:port``."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold gRPC or torch threads
    n = max(1, min(processes, concurrency, len(jobs)))
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_client_process, daemon=True,
                         args=(target, list(jobs[i::n]), max_new_tokens, concurrency // n + (i < concurrency % n),
                               channels, timeout, barrier, out, api)) for i in range(n)]
    for p in procs:
        p.start()
    results: list[StreamResult] = []
    try:
        got = 0
        while got < n:  # read before joining: a child cannot exit while its results fill the pipe
            try:
                results.extend(out.get(timeout=1.0))
                got += 1
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process died (exit codes {dead})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def status_counts(results: Sequence[StreamResult]) -> dict[str, int]:
    return dict(sorted(Counter(r.code for r in results).items()))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between the two nearest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def short_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Varied short prompts (1 to 16 token ids, none a special token below 3), deterministic."""
    return [[3 + (seed * 7919 + i * 131 + j * 17) % (vocab_size - 3) for j in range(1 + (i * 7 + seed) % 16)]
            for i in range(count)]
