"""Fuzzing the engine's ``Engine.Forward`` stream and the bytes on the gRPC ports (``hypothesis``, bounded).

- ForwardBatches (every field drawn on its own; shapes that agree with at most one field out of range;
  real batches with fields mutated) each get well-formed results or a clear INVALID_ARGUMENT on a stream
  of their own; afterwards a new stream is still token-exact against ``LLM.generate``. ``Forward`` trusts
  its caller with every KV slot (issue 27: mutual TLS and the NetworkPolicy keep others off the port),
  so nothing streams alongside the batches themselves: a valid batch may overwrite any request's KV.
- Bytes (no HTTP/2, HTTP/2 frames of any kind, gRPC calls with garbage message framing) and garbage
  protobuf bytes for the real methods, on the engine's and the router's ports: both keep serving, and
  greedy streams alongside end exact; bytes that do not parse as the method's request are
  INVALID_ARGUMENT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.config import EngineConfig
from modeserve.engine.models.loader import open_checkpoint
from modeserve.engine.runner.model_runner import ModelRunner
from modeserve.proto.v1 import engine_pb2, engine_pb2_grpc, forward_pb2
from modeserve.service.bench.fuzz_batches import i64, mutated_batches, random_batches, shaped_batches
from modeserve.service.bench.fuzz_cases import ENGINE_METHODS, ROUTER_METHODS, garbage_calls, raw_streams
from modeserve.service.bench.fuzz_probes import (Reply, Witness, batch_limits, engine_greedy, forward_reply,
                                                 garbage_reply, generate_greedy, raw_reply, valid_batches)
from modeserve.service.router.app import RouterApp
from modeserve.service.router.in_process import start_serve
from modeserve.service.rpc.batch_checks import BatchLimits
from modeserve.service.rpc.engine_client import engine_healthy
from modeserve.service.rpc.engine_server import create_engine_server
from tests.service.http_fixtures import tiny_model_with_tokenizer
from tests.service.test_serve import wait_idle

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                derandomize=True)
PROMPT = [5, 6, 7]
WITNESS_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """With a tokenizer: Tokenize, text and chat requests are served, not refused for want of one."""
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-fuzz-engine"))


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[str]:
    config = EngineConfig.from_kwargs(model=str(tiny_model), page_size=4, kv_cache_tokens=1024, max_running_requests=6)
    srv = create_engine_server(ModelRunner(config.runner, open_checkpoint(tiny_model)), "127.0.0.1:0",
                               model_path=str(tiny_model))
    yield f"127.0.0.1:{srv.port}"
    srv.stop(0)


@pytest.fixture(scope="module")
def channel(engine: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(engine) as ch:
        yield ch


@pytest.fixture(scope="module")
def limits(channel: grpc.Channel) -> BatchLimits:
    return batch_limits(engine_pb2_grpc.EngineStub(channel).Describe(engine_pb2.DescribeRequest()))


@pytest.fixture(scope="module")
def valid(channel: grpc.Channel) -> list[forward_pb2.ForwardBatch]:
    batches = valid_batches(channel)
    modes = {forward_pb2.FORWARD_MODE_EXTEND, forward_pb2.FORWARD_MODE_MIXED, forward_pb2.FORWARD_MODE_DECODE,
             forward_pb2.FORWARD_MODE_TARGET_VERIFY}
    assert {b.forward_mode for b in batches} == modes
    assert any(b.slot_updates for b in batches) and any(b.admissions for b in batches)
    return batches


@pytest.fixture(scope="module")
def expect(tiny_model: Path) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=WITNESS_TOKENS, ignore_eos=True)
    return LLM(model=str(tiny_model), page_size=16).generate(prompt_token_ids=[PROMPT], sampling_params=sp)[0].token_ids


@pytest.fixture
def exact_afterwards(engine: str, channel: grpc.Channel, expect: list[int]) -> Iterator[None]:
    """After the test: the engine serves, and a new stream's greedy tokens are LLM.generate's."""
    yield
    assert engine_healthy(engine)
    assert engine_greedy(channel, PROMPT, WITNESS_TOKENS) == expect


@pytest.fixture
def engine_alongside(engine: str, channel: grpc.Channel, expect: list[int]) -> Iterator[None]:
    """Greedy streams of a scheduler of our own on the engine, one after another for the whole test."""
    witness = Witness(lambda: engine_greedy(channel, PROMPT, WITNESS_TOKENS), expect)
    yield
    assert witness.finish(), witness.failures[:3]
    assert engine_healthy(engine)


@pytest.fixture(scope="module")
def router(tiny_model: Path) -> Iterator[RouterApp]:
    app = start_serve("127.0.0.1:0", str(tiny_model), page_size=4, kv_cache_tokens=4096)
    yield app
    app.stop(grace=1)


@pytest.fixture
def router_alongside(router: RouterApp, expect: list[int]) -> Iterator[str]:
    """Greedy streams through the router for the whole test; then its KV pool is idle again."""
    address = f"127.0.0.1:{router.port}"
    with grpc.insecure_channel(address) as ch:
        witness = Witness(lambda: generate_greedy(ch, PROMPT, WITNESS_TOKENS), expect)
        yield address
        assert witness.finish(), witness.failures[:3]
    wait_idle(router, timeout=30)


def check(reply: Reply) -> None:
    assert reply.verdict != "other", reply


# ---- regressions: batches the engine once served wrongly -----------------------------------------
def batch(mode: int, ext: list[int], mask: list[int]) -> forward_pb2.ForwardBatch:
    """Requests in rows 0, 1, ... with no prefix, token 5 at each position, KV slots from 4 on."""
    tokens = [j for e in ext for j in range(e)]
    return forward_pb2.ForwardBatch(
        forward_mode=mode,  # type: ignore[arg-type]  # an open enum: any number travels
        req_pool_indices=i64(range(len(ext))), prefix_lens=i64([0] * len(ext)),
        extend_lens=i64(ext), sample_mask=bytes(mask), input_ids=i64([5] * len(tokens)), positions=i64(tokens),
        out_cache_loc=i64(range(4, 4 + len(tokens))))


REFUSED = {  # name: (batch, what the refusal names, the same batch with its shape right)
    # used to fail with IndexError (INTERNAL) while keeping the accepted drafts
    "verify_without_tokens": (batch(5, [0, 2], [0, 1]), "TARGET_VERIFY", batch(5, [1, 2], [0, 1])),
    # used to be served with no token for a row that samples
    "idle_with_requests": (batch(4, [1], [1]), "IDLE", batch(2, [1], [1])),
    # DECODE graphs hold one query a request, every one sampled; eager CPU steps used to run these
    "decode_of_two_tokens": (batch(2, [2, 1], [1, 1]), "DECODE", batch(3, [2, 1], [1, 1])),
    "decode_without_sampling": (batch(2, [1, 1], [1, 0]), "DECODE", batch(2, [1, 1], [1, 1])),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_mode_shape_mismatch_is_refused(channel: grpc.Channel, limits: BatchLimits, exact_afterwards: None,
                                        case: str) -> None:
    bad, field, good = REFUSED[case]
    assert forward_reply(channel, [good], limits.vocab_size).status == "OK"
    reply = forward_reply(channel, [good, bad], limits.vocab_size)
    assert reply.status == "INVALID_ARGUMENT" and field in reply.detail, reply


def test_undecodable_batch_ends_the_stream_invalid_argument(channel: grpc.Channel) -> None:
    """The batch before it is served; the stream used to end OK after it, as if the router had closed it."""
    results = []
    with pytest.raises(grpc.RpcError) as info:
        for r in channel.stream_stream("/modeserve.v1.Engine/Forward")(
                iter([batch(1, [3], [1]).SerializeToString(), b"\xff\xff\xff"]), timeout=30):
            results.append(forward_pb2.ForwardResult.FromString(r))
    assert len(results) == 1 and len(results[0].next_token_ids) == 8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in (info.value.details() or "")


# ---- ForwardBatches --------------------------------------------------------------------------------
@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_random_forward_batches(channel: grpc.Channel, limits: BatchLimits, exact_afterwards: None,
                                data: st.DataObject) -> None:
    m = data.draw(random_batches(limits) | shaped_batches(limits))
    check(forward_reply(channel, [m], limits.vocab_size))


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_mutated_forward_batches(channel: grpc.Channel, limits: BatchLimits, valid: list[forward_pb2.ForwardBatch],
                                 exact_afterwards: None, data: st.DataObject) -> None:
    check(forward_reply(channel, data.draw(mutated_batches(valid, limits)), limits.vocab_size))


# ---- bytes on the gRPC ports -----------------------------------------------------------------------
@pytest.mark.slow
@FUZZ
@given(data=raw_streams(sorted(ENGINE_METHODS)))
def test_bytes_on_the_engine_port(engine: str, engine_alongside: None, data: bytes) -> None:
    check(raw_reply(engine, data))


@pytest.mark.slow
@FUZZ
@given(call=garbage_calls(ENGINE_METHODS))
def test_garbage_messages_on_the_engine_port(channel: grpc.Channel, engine_alongside: None,
                                             call: tuple[str, list[bytes]]) -> None:
    check(garbage_reply(channel, ENGINE_METHODS, *call))


@pytest.mark.slow
@FUZZ
@given(data=raw_streams(sorted(ROUTER_METHODS)))
def test_bytes_on_the_router_port(router_alongside: str, data: bytes) -> None:
    check(raw_reply(router_alongside, data))


@pytest.mark.slow
@FUZZ
@given(call=garbage_calls(ROUTER_METHODS))
def test_garbage_messages_on_the_router_port(router_alongside: str, call: tuple[str, list[bytes]]) -> None:
    with grpc.insecure_channel(router_alongside) as ch:
        check(garbage_reply(ch, ROUTER_METHODS, *call))
