"""The HTTP API's edges on an in-process ``serve`` (its KV pool in reach): a client that disconnects
mid-stream or mid-request frees its KV; a full queue is 429 and every accepted request completes;
a draining router is 503 on ``/health`` and on new requests; keep-alive connections carry many."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from modeserve.service.router.app import HttpAddress, RouterApp
from modeserve.service.router.in_process import start_serve
from tests.service.http_fixtures import call, tiny_model_with_tokenizer
from tests.service.test_serve import wait_idle

pytestmark = pytest.mark.slow
MAX_QUEUED = 4


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterApp, str]]:
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-http-edges"))
    app = start_serve("127.0.0.1:0", str(model), max_queued_requests=MAX_QUEUED, page_size=4, kv_cache_tokens=4096,
                      http=HttpAddress("127.0.0.1", 0))
    assert app.http is not None
    yield app, f"http://127.0.0.1:{app.http.port}"
    app.stop(grace=1)


def raw_post(port: int, path: str, body: dict[str, object]) -> socket.socket:
    """A POST written on a plain socket (so that the test can hang up whenever it likes)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def running(app: RouterApp) -> int:
    return len(app.loops[0].scheduler.running)


def decoded(app: RouterApp) -> int:
    return sum(app.loops[0].scheduler.stats.mode_requests.values())


def wait_running(app: RouterApp, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not running(app) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running(app), "the request never started"


def test_disconnect_mid_stream_frees_the_kv(app: tuple[RouterApp, str]) -> None:
    router, base = app
    wait_idle(router)
    before = decoded(router)
    sock = raw_post(int(base.rsplit(":", 1)[1]), "/v1/completions",
                    {"prompt": [5, 6, 7], "max_tokens": 240, "stream": True, "ignore_eos": True})
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    wait_running(router)
    sock.close()
    wait_idle(router)
    assert decoded(router) - before < 120  # aborted: not run to its 240 tokens


def test_disconnect_mid_request_frees_the_kv(app: tuple[RouterApp, str]) -> None:
    router, base = app
    wait_idle(router)
    sock = raw_post(int(base.rsplit(":", 1)[1]), "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True})
    before = decoded(router)
    wait_running(router)
    sock.close()
    wait_idle(router)
    assert decoded(router) - before < 100


def test_full_queue_is_429_and_every_accepted_request_completes(app: tuple[RouterApp, str]) -> None:
    router, base = app
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda _: call(base, "/v1/completions", body), range(24)))
    codes = sorted({status for status, _ in results})
    assert codes == [200, 429], codes
    for status, out in results:
        if status == 200:
            assert out["usage"]["completion_tokens"] == 40 and out["choices"][0]["finish_reason"] == "length"
        else:
            assert out["error"]["type"] == "rate_limit_error" and out["error"]["code"] == "queue_full"
    wait_idle(router)


def test_draining_is_503_on_health_and_new_requests(app: tuple[RouterApp, str]) -> None:
    router, base = app
    assert call(base, "/health") == (200, {"status": "ok"})
    generation = router.servicer.generation
    generation.draining = True  # what RouterApp.stop sets first
    try:
        assert call(base, "/health")[0] == 503
        status, err = call(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert status == 503 and err["error"]["type"] == "service_unavailable_error"
    finally:
        generation.draining = False
    assert call(base, "/health")[0] == 200


def test_keep_alive_connection_serves_request_after_request(app: tuple[RouterApp, str]) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", int(app[1].rsplit(":", 1)[1]), timeout=30)
    try:
        for _ in range(5):
            conn.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6], "max_tokens": 3}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["object"] == "text_completion"
    finally:
        conn.close()


def test_tokenize_and_detokenize_round_trip(app: tuple[RouterApp, str], tmp_path: Path) -> None:
    _, base = app
    status, tok = call(base, "/tokenize", {"prompt": "Hello, world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 256
    status, text = call(base, "/detokenize", {"tokens": tok["tokens"]})
    assert (status, text) == (200, {"prompt": "Hello, world"})
    assert call(base, "/tokenize", {})[0] == 400  # neither prompt nor messages


def test_http_request_span_is_a_child_of_the_clients_traceparent(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modeserve.service.telemetry.tracing import Tracing

    model = tiny_model_with_tokenizer(tmp_path / "m")
    exporter = InMemorySpanExporter()
    app = start_serve("127.0.0.1:0", str(model), tracing=Tracing("router", 0, env={}, exporter=exporter),
                      page_size=4, http=HttpAddress("127.0.0.1", 0))
    assert app.http is not None
    port = app.http.port
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True})
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json",
                                              "traceparent": f"00-{trace_id}-{parent_id}-01"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 3
    finally:
        app.stop(grace=1)
    spans = exporter.get_finished_spans()
    (chat,) = [s for s in spans if s.name.startswith("chat ")]
    assert chat.context is not None and format(chat.context.trace_id, "032x") == trace_id
    assert chat.parent is not None and format(chat.parent.span_id, "016x") == parent_id
    assert chat.attributes is not None and chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.usage.output_tokens"] == 3
    forwards = [s for s in spans if s.name == "modeserve.forward"]
    assert {s.attributes["modeserve.forward_mode"] for s in forwards if s.attributes} >= {"EXTEND", "DECODE"}


def test_http_socket_says_tcp_so_asyncio_turns_nagle_off() -> None:
    """asyncio sets TCP_NODELAY on accepted sockets only when the listening one is IPPROTO_TCP; with
    Nagle on, each SSE chunk on a kept-alive connection waited for the client's delayed ACK."""
    from modeserve.service.http.server import bind

    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP and sock.type == socket.SOCK_STREAM
    finally:
        sock.close()
