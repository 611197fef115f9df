"""Fuzzing the public APIs (``hypothesis``, bounded): random HTTP bodies (JSON near the OpenAI
schema, arbitrary JSON, raw bytes) and random ``GenerateRequest``s get a served answer or a clear
400 / INVALID_ARGUMENT, never a 5xx, a crash or a hang; a stream running alongside the whole time
ends token-exact, and the KV pool returns to idle."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any, Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modeserve.engine import LLM, SamplingParams
from modeserve.proto.v1 import generate_pb2
from modeserve.service.router.app import HttpAddress, RouterApp
from modeserve.service.router.in_process import start_serve
from modeserve.service.rpc.client import GenerateClient
from tests.service.http_fixtures import free_port, tiny_model_with_tokenizer
from tests.service.test_serve import wait_idle

pytestmark = pytest.mark.slow
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                derandomize=True)
SERVED_OR_REFUSED = {200, 400, 404, 405, 413}
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "stream", "stream_options",
          "echo", "ignore_eos", "repetition_penalty", "frequency_penalty", "presence_penalty", "tokens",
          "return_token_ids", "user"]
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
small_ints = st.integers(-5, 300)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=30) | json_values}), max_size=3)
near_schema = st.fixed_dictionaries({}, optional={
    "messages": messages | json_values, "prompt": st.text(max_size=30) | st.lists(small_ints, max_size=8) | json_values,
    "max_tokens": small_ints | json_values, "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5), "top_k": small_ints, "stop": st.text(max_size=4) | st.lists(st.text(max_size=4)),
    "stream": st.booleans(), "logprobs": st.booleans() | small_ints, "top_logprobs": small_ints,
    "n": small_ints, "seed": st.integers(-10, 2**65), "echo": st.booleans(), "tokens": st.lists(small_ints),
    "stop_token_ids": st.lists(st.integers(-5, 10**6), max_size=3), "model": st.text(max_size=10) | json_values})


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterApp, str, str]]:
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-fuzz"))
    port = free_port()
    app = start_serve("127.0.0.1:0", str(model), page_size=4, kv_cache_tokens=8192, max_queued_requests=512,
                      http=HttpAddress("127.0.0.1", port))
    yield app, f"http://127.0.0.1:{port}", str(model)
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


def send(base: str, path: str, data: bytes | None) -> tuple[int, bytes]:
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def check(status: int, body: bytes) -> None:
    assert status in SERVED_OR_REFUSED, (status, body[:500])
    if status != 200:
        error = json.loads(body)["error"]
        assert error["message"] and set(error) == {"message", "type", "param", "code"}


@FUZZ
@given(path=st.sampled_from(PATHS), body=near_schema)
def test_http_bodies_near_the_schema(app: tuple[RouterApp, str, str], witness: list[int], path: str,
                                     body: dict[str, Any]) -> None:
    check(*send(app[1], path, json.dumps(body).encode()))


@FUZZ
@given(path=st.sampled_from(PATHS[:4]), body=json_values | st.dictionaries(st.sampled_from(FIELDS), json_values))
def test_http_arbitrary_json(app: tuple[RouterApp, str, str], witness: list[int], path: str, body: Any) -> None:
    check(*send(app[1], path, json.dumps(body).encode()))


@FUZZ
@given(path=st.sampled_from(PATHS[:4]), raw=st.binary(max_size=200))
def test_http_raw_bytes(app: tuple[RouterApp, str, str], witness: list[int], path: str, raw: bytes) -> None:
    check(*send(app[1], path, raw))


sampling = st.builds(
    generate_pb2.SamplingParams, max_new_tokens=st.integers(-2**31, 300), temperature=st.floats(-2, 3, width=32),
    top_p=st.floats(-1, 2, width=32), top_k=st.integers(-2**31, 2**31 - 1), min_p=st.floats(-1, 2, width=32),
    seed=st.integers(0, 2**64 - 1), stop=st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=3), ignore_eos=st.booleans(),
    logprobs=st.integers(-3, 30), repetition_penalty=st.floats(-1, 3, width=32),
    frequency_penalty=st.floats(-3, 3, width=32), presence_penalty=st.floats(-3, 3, width=32))
requests = st.builds(generate_pb2.GenerateRequest, text=st.text(max_size=60),
                     token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=20), chat=st.booleans(),
                     sampling=sampling)


@FUZZ
@given(request=requests)
def test_random_generate_requests(app: tuple[RouterApp, str, str], witness: list[int],
                                  request: generate_pb2.GenerateRequest) -> None:
    client = GenerateClient(f"127.0.0.1:{app[0].port}")
    try:
        for _ in client.stub.Generate(request, timeout=60):
            pass
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details(), request)
        assert err.details()
    finally:
        client.close()
