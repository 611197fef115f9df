"""What one client may hold on a server: ``--max-streams-per-connection`` caps a connection's
concurrent streams (the rest wait at the client and complete later; another connection is not
held up); ``--no-reflection`` turns server reflection off."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from modeserve.service.router.app import RouterApp
from modeserve.service.router.in_process import start_serve
from modeserve.service.rpc.client import Completion, GenerateClient
from modeserve.service.rpc.grpc_server import ServerOptions


@pytest.fixture(scope="module")
def app(tiny_model: Path) -> Iterator[RouterApp]:
    app = start_serve("127.0.0.1:0", str(tiny_model), page_size=4,
                      options=ServerOptions(max_streams_per_connection=2, reflection=False))
    yield app
    app.stop(grace=1)


def test_a_connection_holds_at_most_its_streams_and_the_rest_complete_later(app: RouterApp) -> None:
    client = GenerateClient(f"127.0.0.1:{app.port}")
    # one call first: until the client has the server's SETTINGS (MAX_CONCURRENT_STREAMS) it may open
    # more streams than allowed, and HTTP/2 refuses the excess (RST_STREAM REFUSED_STREAM: UNAVAILABLE)
    assert client.generate(token_ids=[5, 6, 7], max_new_tokens=1).completion_tokens == 1
    outs: list[Completion] = []
    threads = [threading.Thread(target=lambda: outs.append(client.generate(token_ids=[5, 6, 7], max_new_tokens=200,
                                                                           ignore_eos=True))) for _ in range(4)]
    for t in threads:
        t.start()
    sched = app.loops[0].scheduler
    seen = 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(outs) < 2:
        seen = max(seen, len(sched.running) + len(sched.waiting))
        time.sleep(0.002)
    other = GenerateClient(f"127.0.0.1:{app.port}")  # a second connection has its own streams
    try:
        assert other.generate(token_ids=[8, 9], max_new_tokens=2).completion_tokens == 2
    finally:
        other.close()
    for t in threads:
        t.join(timeout=60)
    client.close()
    assert seen == 2  # never more than the connection's two at once
    assert [o.completion_tokens for o in outs] == [200] * 4


def test_reflection_can_be_turned_off(app: RouterApp) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max-streams-per-connection"):
        ServerOptions(max_streams_per_connection=0)
