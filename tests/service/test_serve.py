"""``modeserve serve`` (router + scheduler + in-process engine) through a real gRPC client."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modeserve.engine import LLM, SamplingParams
from modeserve.service.rpc.client import Completion, GenerateClient
from modeserve.service.router.app import RouterApp
from modeserve.service.router.in_process import start_serve
from tests.engine.tiny_models import COMMON, mixed_prompts

ENGINE_ARGS = dict(page_size=4, kv_cache_tokens=4096, chunked_prefill_size=32, enable_mixed=True,
                   max_prefill_ratio=0.5)


@pytest.fixture(scope="module")
def app(tiny_model: Path) -> Iterator[RouterApp]:
    app = start_serve("127.0.0.1:0", str(tiny_model), max_queued_requests=128, **ENGINE_ARGS)
    yield app
    app.stop(grace=1)


@pytest.fixture(scope="module")
def client(app: RouterApp) -> Iterator[GenerateClient]:
    c = GenerateClient(f"127.0.0.1:{app.port}")
    yield c
    c.close()


def reference(tiny_model: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    llm = LLM(model=str(tiny_model), page_size=16)
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]


def generate_all(client: GenerateClient, prompts: list[list[int]], max_new: int) -> list[Completion]:
    """All prompts as concurrent greedy streams (one thread each)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(token_ids=p, max_new_tokens=max_new, ignore_eos=True),
                             prompts))


def exact_streams(client: GenerateClient, tiny_model: Path, prompts: list[list[int]], max_new: int) -> list[Completion]:
    """``generate_all``, each stream's tokens checked against greedy ``LLM.generate`` (run first): the completions."""
    expect = reference(tiny_model, prompts, max_new)
    outs = generate_all(client, prompts, max_new)
    assert [o.token_ids for o in outs] == expect
    return outs


def wait_idle(app: RouterApp, timeout: float = 10.0) -> None:
    """The KV pool returns to its idle size: every page free or evictable, no request running."""
    sched = app.loops[0].scheduler
    deadline = time.time() + timeout
    while time.time() < deadline:
        kv = sched.kv
        cached = kv.cache.num_evictable_pages if kv.cache is not None else 0
        if not sched.running and not sched.waiting and kv.pool.num_free_pages + cached == kv.pool.num_total_pages:
            return
        time.sleep(0.02)
    raise AssertionError(f"not idle: running={len(sched.running)} free={sched.kv.pool.num_free_pages}")


def test_streamed_greedy_equals_llm_generate(app: RouterApp, client: GenerateClient, tiny_model: Path) -> None:
    prompts = mixed_prompts(8, COMMON["vocab_size"], seed=5)
    expect = reference(tiny_model, prompts, 10)
    for prompt, ref in zip(prompts, expect):
        out = client.generate(token_ids=prompt, max_new_tokens=10, ignore_eos=True)
        assert out.token_ids == ref and out.finish_reason == "length"
        assert out.prompt_tokens == len(prompt) and out.completion_tokens == 10
        assert out.num_messages >= 2  # streamed, not one blob


def test_64_concurrent_streams_all_complete_and_correct(app: RouterApp, client: GenerateClient,
                                                         tiny_model: Path) -> None:
    prompts = mixed_prompts(64, COMMON["vocab_size"], seed=6, max_len=40)
    outs = exact_streams(client, tiny_model, prompts, 8)
    assert all(o.finish_reason == "length" for o in outs)
    wait_idle(app)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(), "prompt is empty"),
        (dict(text="hi", token_ids=[5]), "not both"),
        (dict(token_ids=list(range(3, 3 + 256))), "token_ids"),
        (dict(token_ids=[5, 384]), "token_ids"),
        (dict(token_ids=[5], max_new_tokens=-1), "max_new_tokens"),
        (dict(token_ids=[5], max_new_tokens=10**6), "max_new_tokens"),
        (dict(token_ids=[5], temperature=-1.0), "temperature"),
        (dict(token_ids=[5], top_p=1.5), "top_p"),
        (dict(token_ids=[5], top_p=-0.1), "top_p"),
        (dict(token_ids=[5], top_k=-2), "top_k"),
        (dict(text="x" * (10 * 2**20)), "text"),
    ],
)
def test_bad_input_is_invalid_argument_and_server_keeps_serving(client: GenerateClient, kwargs: dict,
                                                                field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(**kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.value.details() or "")
    assert client.generate(token_ids=[5, 6], max_new_tokens=2).completion_tokens == 2


def test_cancelled_stream_frees_its_kv(app: RouterApp, client: GenerateClient) -> None:
    wait_idle(app)
    stats = app.loops[0].scheduler.stats
    before = sum(stats.mode_requests.values())
    stream = client.stream(token_ids=[5, 6, 7], max_new_tokens=200, ignore_eos=True)
    next(stream)
    assert app.loops[0].scheduler.running
    stream.cancel()
    wait_idle(app)
    assert sum(stats.mode_requests.values()) - before < 100  # aborted, not run to its 200 tokens


def test_deadline_is_honoured(app: RouterApp, client: GenerateClient) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(token_ids=[5, 6, 7], max_new_tokens=240, ignore_eos=True, timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(app)


def test_full_queue_is_resource_exhausted(tiny_model: Path) -> None:
    small = start_serve("127.0.0.1:0", str(tiny_model), max_queued_requests=2, **ENGINE_ARGS)
    c = GenerateClient(f"127.0.0.1:{small.port}")
    try:
        streams = [c.stream(token_ids=[5, 6], max_new_tokens=200, ignore_eos=True) for _ in range(2)]
        for s in streams:
            next(s)
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=[5], max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in streams:
            s.cancel()
    finally:
        c.close()
        small.stop(grace=0.5)


def test_health_and_reflection(app: RouterApp) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "modeserve.v1.Generate"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"modeserve.v1.Generate", "grpc.health.v1.Health"} <= names


def test_model_info(client: GenerateClient) -> None:
    info = client.model_info()
    assert info.vocab_size == COMMON["vocab_size"] and info.context_length == 256 and info.num_ranks == 1


def test_text_chat_on_default_model() -> None:
    app = start_serve("127.0.0.1:0", None)
    c = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        out = c.generate(text="What is the capital of France?", chat=True, max_new_tokens=24)
        assert "Paris" in out.text and out.finish_reason in ("stop", "length")
        ids = c.tokenize("What is the capital of France?", chat=True)
        assert out.prompt_tokens == len(ids)
        llm_text = LLM().generate(prompts=["What is the capital of France?"], chat=True,
                                  sampling_params=SamplingParams(temperature=0.0, max_new_tokens=24))[0].text
        assert out.text == llm_text
        stopped = c.generate(text="What is the capital of France?", chat=True, max_new_tokens=24, stop=["Paris"])
        assert stopped.finish_reason == "stop" and "Paris" not in stopped.text and stopped.text
    finally:
        c.close()
        app.stop(grace=0.5)


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_under_load_keeps_streams_exact(tiny_model: Path, overlap: bool) -> None:
    tight = start_serve("127.0.0.1:0", str(tiny_model), overlap=overlap, page_size=4, kv_cache_tokens=128,
                        chunked_prefill_size=64)
    c = GenerateClient(f"127.0.0.1:{tight.port}")
    try:
        prompts = mixed_prompts(16, COMMON["vocab_size"], seed=7, max_len=40)
        exact_streams(c, tiny_model, prompts, 12)
        assert tight.loops[0].scheduler.stats.num_retractions > 0
        wait_idle(tight)
    finally:
        c.close()
        tight.stop(grace=0.5)
