"""Fuzzing the public APIs (``hypothesis``, bounded): random HTTP bodies (JSON near the OpenAI
schema, arbitrary JSON, raw bytes) and random ``GenerateRequest``s get a served answer or a clear
400 / INVALID_ARGUMENT, never a 5xx, a crash or a hang; a stream running alongside the whole time
ends token-exact, and the KV pool returns to idle."""

from __future__ import annotations

import json
import threading
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modeserve.engine import LLM, SamplingParams
from modeserve.proto.v1 import generate_pb2
from modeserve.service.bench.fuzz_cases import HTTP_PATHS, any_json, generate_requests, near_schema
from modeserve.service.bench.fuzz_probes import Reply, generate_reply, http_reply
from modeserve.service.router.app import HttpAddress, RouterApp
from modeserve.service.router.in_process import start_serve
from modeserve.service.rpc.client import GenerateClient
from tests.service.http_fixtures import tiny_model_with_tokenizer
from tests.service.test_serve import wait_idle

pytestmark = pytest.mark.slow
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                derandomize=True)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterApp, str, str]]:
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-fuzz"))
    app = start_serve("127.0.0.1:0", str(model), page_size=4, kv_cache_tokens=8192, max_queued_requests=512,
                      http=HttpAddress("127.0.0.1", 0))
    assert app.http is not None
    yield app, f"http://127.0.0.1:{app.http.port}", str(model)
    app.stop(grace=1)


@pytest.fixture(scope="module")
def witness(app: tuple[RouterApp, str, str]) -> Iterator[list[int]]:
    """A greedy stream open for the whole module; checked token-exact at the end."""
    router, _, model = app
    client = GenerateClient(f"127.0.0.1:{router.port}")
    got: list[int] = []
    stream = client.stream(token_ids=[5, 6, 7], max_new_tokens=240, ignore_eos=True)
    thread = threading.Thread(target=lambda: [got.extend(m.token_ids) for m in stream])
    thread.start()
    yield got
    thread.join(timeout=120)
    client.close()
    ref = LLM(model=model, page_size=16).generate(
        prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=240,
                                                                      ignore_eos=True))[0]
    assert got == ref.token_ids
    wait_idle(router, timeout=30)


def check(reply: Reply) -> None:
    assert reply.verdict != "other", reply


@FUZZ
@given(path=st.sampled_from(HTTP_PATHS), body=near_schema)
def test_http_bodies_near_the_schema(app: tuple[RouterApp, str, str], witness: list[int], path: str,
                                     body: dict[str, Any]) -> None:
    check(http_reply(app[1], path, json.dumps(body).encode()))


@FUZZ
@given(path=st.sampled_from(HTTP_PATHS[:4]), body=any_json)
def test_http_arbitrary_json(app: tuple[RouterApp, str, str], witness: list[int], path: str, body: Any) -> None:
    check(http_reply(app[1], path, json.dumps(body).encode()))


@FUZZ
@given(path=st.sampled_from(HTTP_PATHS[:4]), raw=st.binary(max_size=200))
def test_http_raw_bytes(app: tuple[RouterApp, str, str], witness: list[int], path: str, raw: bytes) -> None:
    check(http_reply(app[1], path, raw))


@FUZZ
@given(request=generate_requests)
def test_random_generate_requests(app: tuple[RouterApp, str, str], witness: list[int],
                                  request: generate_pb2.GenerateRequest) -> None:
    client = GenerateClient(f"127.0.0.1:{app[0].port}")
    try:
        check(generate_reply(client.channel, request))
    finally:
        client.close()
