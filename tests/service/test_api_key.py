"""``--api-key``: Generate calls and HTTP requests without the key, or with a wrong one, are refused
(UNAUTHENTICATED / 401 with OpenAI's error JSON); with it they are served; health and reflection
answer without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from modeserve.service.router.api_key import bearer_ok, load_api_key
from modeserve.service.router.app import HttpAddress, RouterApp
from modeserve.service.router.in_process import start_serve
from modeserve.service.rpc.client import GenerateClient
from tests.service.http_fixtures import call, tiny_model_with_tokenizer

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterApp, str]]:
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-key"))
    app = start_serve("127.0.0.1:0", str(model), page_size=4, http=HttpAddress("127.0.0.1", 0), api_key=KEY)
    assert app.http is not None
    yield app, f"http://127.0.0.1:{app.http.port}"
    app.stop(grace=1)


@pytest.mark.parametrize("key", [None, "wrong", KEY + "x", KEY[:-1]])
def test_generate_without_the_key_is_unauthenticated(app: tuple[RouterApp, str], key: str | None) -> None:
    client = GenerateClient(f"127.0.0.1:{app[0].port}", api_key=key)
    try:
        for call_it in (lambda: client.generate(token_ids=[5, 6], max_new_tokens=2), lambda: client.tokenize("hi"),
                        client.model_info):
            with pytest.raises(grpc.RpcError) as err:
                call_it()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        client.close()


def test_generate_with_the_key_is_served_and_probes_need_none(app: tuple[RouterApp, str]) -> None:
    client = GenerateClient(f"127.0.0.1:{app[0].port}", api_key=KEY)
    try:
        assert client.generate(token_ids=[5, 6], max_new_tokens=3, ignore_eos=True).completion_tokens == 3
    finally:
        client.close()
    with grpc.insecure_channel(f"127.0.0.1:{app[0].port}") as channel:  # no key at all
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="modeserve.v1.Generate"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert "modeserve.v1.Generate" in {s.name for s in reply.list_services_response.service}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_http_without_the_key_is_401(app: tuple[RouterApp, str], headers: dict[str, str]) -> None:
    import json
    import urllib.error
    import urllib.request

    for path, body in (("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}), ("/v1/models", None),
                       ("/tokenize", {"prompt": "hi"})):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(app[1] + path, data=data, headers={"Content-Type": "application/json", **headers})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 401
        error = json.loads(err.value.read())["error"]
        assert error["code"] == "invalid_api_key" and "API key" in error["message"]
    assert call(app[1], "/health")[0] == 200  # the readiness probe needs no key


def test_openai_client_with_the_key_is_served(app: tuple[RouterApp, str]) -> None:
    client = openai.OpenAI(base_url=f"{app[1]}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=[5, 6, 7], max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{app[1]}/v1", api_key="wrong", max_retries=0).models.list()


def test_client_command_sends_the_key(app: tuple[RouterApp, str]) -> None:
    base = [sys.executable, "-m", "modeserve.service.cli", "client", "hello", "--server", f"127.0.0.1:{app[0].port}",
            "--max-new-tokens", "2", "--no-chat"]
    assert subprocess.run(base + ["--api-key", KEY], capture_output=True, timeout=120).returncode == 0
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def test_key_loading_and_comparison(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY + "\n")
    assert load_api_key(None, str(tmp_path / "key")) == KEY and load_api_key(KEY, None) == KEY
    assert load_api_key(None, None) is None and load_api_key("", None) is None
    (tmp_path / "empty").write_text("\n")
    for args in ((KEY, str(tmp_path / "key")), (None, str(tmp_path / "empty")), (None, str(tmp_path / "missing"))):
        with pytest.raises(ValueError, match="api-key"):
            load_api_key(*args)
    assert bearer_ok(KEY, f"Bearer {KEY}") and not bearer_ok(KEY, None) and not bearer_ok(KEY, f"bearer {KEY}")
