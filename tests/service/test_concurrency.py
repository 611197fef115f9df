"""Thousands of concurrent streams against a real ``modeserve serve`` process from one ``grpc.aio``
client: every stream ends OK and token-exact against ``LLM.generate``, the server cancels none, and over ``--max-queued-requests`` the excess is refused with
RESOURCE_EXHAUSTED and nothing else. Every status code is counted."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from modeserve.engine import LLM, SamplingParams
from modeserve.proto.v1 import generate_pb2, generate_pb2_grpc
from modeserve.service.bench.servers import spawn
from modeserve.service.rpc.engine_process import engine_flags
from tests.engine.tiny_models import COMMON

NEW_TOKENS = 32
# the server and the reference alike: every stream can run at once, its KV resident
ENGINE_ARGS = dict(page_size=16, max_running_requests=256, kv_cache_tokens=64 * 1024, chunked_prefill_size=2048)
DEADLINE_S = 150.0  # the whole run of one test's streams; past it the test fails, not hangs


@dataclass
class Outcome:
    code: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    end: float = 0.0  # time.monotonic() when the stream ended
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set at its first message or its end


def prompts(count: int) -> list[list[int]]:
    """Varied short prompts: 1 to 16 ids, none special (eos is 2)."""
    v = COMMON["vocab_size"]
    return [[3 + (i * 131 + j * 17 + i // 7) % (v - 3) for j in range(1 + (i * 7) % 16)] for i in range(count)]


def reference(model: Path, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    llm = LLM(model=str(model), **ENGINE_ARGS)  # type: ignore[arg-type]
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=batch, sampling_params=sp)]


async def _generate(stub: generate_pb2_grpc.GenerateStub, i: int, prompt: list[int], new_tokens: int,
                    out: Outcome | None = None) -> Outcome:
    req = generate_pb2.GenerateRequest(request_id=f"c{i}", token_ids=prompt, sampling=generate_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    out = out or Outcome("OK")
    try:
        async for msg in stub.Generate(req):
            out.token_ids.extend(msg.token_ids)
            out.finish_reason = msg.finish_reason or out.finish_reason
            out.started.set()
    except grpc.aio.AioRpcError as exc:
        out.code = exc.code().name
    out.end = time.monotonic()
    out.started.set()
    return out


async def _stream_all(address: str, batch: list[list[int]], new_tokens: int) -> list[Outcome]:
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = generate_pb2_grpc.GenerateStub(channel)
        return await asyncio.gather(*(_generate(stub, i, p, new_tokens) for i, p in enumerate(batch)))


def stream_all(address: str, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[Outcome]:
    """Every prompt as its own stream, all opened at once on one channel."""
    return asyncio.run(asyncio.wait_for(_stream_all(address, batch, new_tokens), DEADLINE_S))


async def _fill_then_overflow(address: str, held: list[list[int]], excess: list[list[int]],
                              new_tokens: int) -> tuple[list[Outcome], list[Outcome]]:
    """Opens the ``held`` streams, waits until each has its first tokens (it is admitted and running), then
    opens the ``excess`` ones on the same channel."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = generate_pb2_grpc.GenerateStub(channel)
        held_out = [Outcome("OK") for _ in held]
        running = [asyncio.ensure_future(_generate(stub, i, p, new_tokens, o)) for i, (p, o) in enumerate(zip(held, held_out))]
        await asyncio.gather(*(o.started.wait() for o in held_out))
        over = await asyncio.gather(*(_generate(stub, len(held) + i, p, new_tokens) for i, p in enumerate(excess)))
        return list(await asyncio.gather(*running)), list(over)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[str]:
    with spawn("serve", "--model", str(tiny_model), "--max-queued-requests", "8192",
               *engine_flags(ENGINE_ARGS)) as address:
        yield address


@pytest.mark.parametrize("count", [500, pytest.param(3000, marks=pytest.mark.slow)])
def test_concurrent_streams_all_complete_token_exact(server: str, tiny_model: Path, count: int) -> None:
    batch = prompts(count)
    outcomes = stream_all(server, batch)
    codes = Counter(o.code for o in outcomes)
    assert codes == {"OK": count}, f"status codes of {count} streams: {dict(codes)}"  # CANCELLED among them: the server's
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS for o in outcomes)
    expect = reference(tiny_model, batch)
    wrong = [i for i, (o, e) in enumerate(zip(outcomes, expect)) if o.token_ids != e]
    assert len(wrong) <= max(1, count // 1000), f"{len(wrong)} of {count} streams differ from LLM.generate: {wrong[:5]}"
    for i in wrong:
        assert_diverges_at_a_tie(tiny_model, batch[i], outcomes[i].token_ids, expect[i])


def assert_diverges_at_a_tie(model: Path, prompt: list[int], got: list[int], expect: list[int]) -> None:
    """Greedy decoding is exact up to float rounding, which depends on what else is in the batch
    (the kernels' reduction order changes with the number of rows), so where the two top tokens'
    logits are within rounding of each other the two runs may choose differently, and differ from
    there on. A stream that differs must do so at such a tie, found by the request decoded alone
    (its top-2 log-probabilities), and choose one of its two tokens."""
    at = next(t for t, (a, b) in enumerate(zip(got, expect)) if a != b)
    llm = LLM(model=str(model), **ENGINE_ARGS)  # type: ignore[arg-type]
    sp = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True, logprobs=2)
    (alone,) = llm.generate(prompt_token_ids=[prompt + got[:at]], sampling_params=sp)
    (first, lp1), (second, lp2) = alone.top_logprobs[0][:2]
    assert {got[at], expect[at]} == {first, second}, f"token {at}: {got[at]} / {expect[at]}, top-2 alone {first}, {second}"
    assert lp1 - lp2 < 1e-4, f"token {at} of {prompt}: no tie (top-2 log-probabilities {lp1}, {lp2})"


def test_over_max_queued_requests_the_excess_is_refused_and_the_rest_complete(tiny_model: Path) -> None:
    limit, excess, new_tokens = 200, 200, 200  # 200 new tokens: as long as the model's 256 positions allow
    batch = prompts(limit + excess)
    with spawn("serve", "--model", str(tiny_model), "--max-queued-requests", str(limit),
               *engine_flags(ENGINE_ARGS)) as address:
        held, over = asyncio.run(asyncio.wait_for(
            _fill_then_overflow(address, batch[:limit], batch[limit:], new_tokens), DEADLINE_S))
    assert Counter(o.code for o in held) == {"OK": limit}  # admitted while the queue had room
    codes = Counter(o.code for o in over)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and codes["RESOURCE_EXHAUSTED"] > 0, dict(codes)
    # the client sees a stream end after the server has freed its slot; an excess stream admitted into a freed
    # slot ends 200 decode steps after it, so if every excess stream ended before the first held one, none
    # found a slot free and every one was refused
    if max(o.end for o in over) < min(o.end for o in held):
        assert codes == {"RESOURCE_EXHAUSTED": excess}, dict(codes)
    accepted = held + [o for o in over if o.code == "OK"]
    prompts_accepted = batch[:limit] + [p for p, o in zip(batch[limit:], over) if o.code == "OK"]
    assert all(o.finish_reason == "length" and len(o.token_ids) == new_tokens for o in accepted)
    assert [o.token_ids for o in accepted] == reference(tiny_model, prompts_accepted, new_tokens)
