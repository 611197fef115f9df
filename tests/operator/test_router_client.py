"""The operator's gRPC ``AdminClient`` against the router's real ``Admin`` service (``service.admin``
over a ``RankTable``): ranks set and read back with their states, errors as ``RouterUnreachable``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from modeserve.operator.ranks import RouterRank
from modeserve.operator.router_client import GrpcAdminClient, RouterUnreachable
from modeserve.proto.v1 import admin_pb2_grpc
from modeserve.service.router.admin_servicer import ADMIN_SERVICE, AdminServicer
from modeserve.service.router.dispatch import Dispatcher
from modeserve.service.router.rank_table import RankTable
from modeserve.service.rpc.grpc_server import EventLoopThread, GrpcServer


def no_engine(rank: int, address: str, on_failure: Any) -> Any:
    raise ConnectionError(f"no engine at {address}")


@pytest.fixture
def router() -> Iterator[str]:
    table = RankTable(no_engine, Dispatcher(), health_interval=0.05)
    events = EventLoopThread()
    server = GrpcServer(events, "127.0.0.1:0",
                       [lambda s: admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(table), s)], [ADMIN_SERVICE])
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.shutdown(0)
        events.close()
        table.close()


def test_set_and_get_ranks_with_states(router: str) -> None:
    client = GrpcAdminClient(timeout=5)
    states = client.set_ranks(router, [RouterRank(0, "127.0.0.1:1", False), RouterRank(1, "127.0.0.1:2", True)])
    assert set(states) == {0, 1} and set(states.values()) <= {"JOINING", "GONE"}
    deadline = time.monotonic() + 5
    while client.get_ranks(router) != {0: "GONE", 1: "GONE"}:  # their engines never answer
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert client.set_ranks(router, []) == {}


def test_errors_are_router_unreachable(router: str) -> None:
    client = GrpcAdminClient(timeout=1)
    with pytest.raises(RouterUnreachable, match="INVALID_ARGUMENT"):
        client.set_ranks(router, [RouterRank(0, "", False)])
    with pytest.raises(RouterUnreachable, match="UNAVAILABLE"):
        client.get_ranks("127.0.0.1:1")


def test_routers_with_tls_are_called_over_tls_with_the_operators_certificate(tmp_path: Any) -> None:
    """An EngineSet with ``spec.tls``: its router's Admin port serves mutual TLS (``router --admin-port``
    with a CA): the operator with ``--tls-ca`` and ``--tls-cert`` gets in, a TLS client without a
    certificate does not, a plaintext call fails, and an operator without ``--tls-ca`` says so instead
    of trying."""
    import trustme

    from modeserve.service.rpc.tls import ReloadingServerCredentials, TlsFiles

    ca = trustme.CA()
    for role, names in (("srv", ("127.0.0.1", "localhost")), ("op", ("operator",))):
        cert = ca.issue_cert(*names)
        cert.cert_chain_pems[0].write_to_path(str(tmp_path / f"{role}.pem"))
        cert.private_key_pem.write_to_path(str(tmp_path / f"{role}.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca_file = str(tmp_path / "ca.pem")
    table = RankTable(no_engine, Dispatcher(), health_interval=0.05)
    events = EventLoopThread()
    creds = ReloadingServerCredentials(TlsFiles(str(tmp_path / "srv.pem"), str(tmp_path / "srv.key"), ca_file), True)
    admin = AdminServicer(table)
    server = GrpcServer(events, "127.0.0.1:0", [lambda s: admin_pb2_grpc.add_AdminServicer_to_server(admin, s)],
                        [ADMIN_SERVICE], credentials=creds.credentials)
    address = f"127.0.0.1:{server.port}"
    operator = TlsFiles(str(tmp_path / "op.pem"), str(tmp_path / "op.key"), ca_file)
    try:
        assert GrpcAdminClient(5, operator).set_ranks(address, [], tls=True) == {}
        with pytest.raises(RouterUnreachable, match="UNAVAILABLE"):
            GrpcAdminClient(5, TlsFiles(ca=ca_file)).get_ranks(address, tls=True)
        with pytest.raises(RouterUnreachable, match="UNAVAILABLE"):
            GrpcAdminClient(2, operator).get_ranks(address)  # plaintext to TLS
        with pytest.raises(RouterUnreachable, match="no --tls-ca"):
            GrpcAdminClient(2).get_ranks(address, tls=True)
    finally:
        server.shutdown(0)
        events.close()
        table.close()
