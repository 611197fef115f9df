"""The operator's handle on an EngineSet's router: ``modeserve.v1.Admin`` (GetRanks / SetRanks).

``AdminClient`` is the small interface the handlers use, so tests replace the gRPC calls; states are
the ``RankState`` names without their prefix (JOINING, READY, DRAINING, DRAINED, GONE).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import grpc

from .ranks import RouterRank
from .resources import ROUTER_ADMIN_PORT
from ..proto.v1 import admin_pb2, admin_pb2_grpc
from ..service.rpc.tls import TlsFiles, open_channel

RouterStates = dict[int, str]


class RouterUnreachable(Exception):
    """The router did not answer (not started yet, restarting, or the network is down)."""


def router_address(name: str, namespace: str) -> str:
    """The Admin port of EngineSet ``name``'s router Service (``resources.router_service``)."""
    return f"{name}.{namespace}.svc:{ROUTER_ADMIN_PORT}"


class AdminClient(Protocol):
    """``tls``: the router serves TLS (its EngineSet's ``spec.tls``)."""

    def get_ranks(self, address: str, tls: bool = False) -> RouterStates: ...

    def set_ranks(self, address: str, ranks: Sequence[RouterRank], tls: bool = False) -> RouterStates:
        """Replace the router's table with ``ranks``; the router's table afterwards."""
        ...


def _states(reply: admin_pb2.RanksStatus) -> RouterStates:
    return {r.rank: admin_pb2.RankState.Name(r.state).removeprefix("RANK_STATE_") for r in reply.ranks}


class GrpcAdminClient:
    """One short-lived channel per call (a reconcile makes two calls every interval); to routers that
    serve TLS over TLS with ``tls`` (the operator's ``--tls-ca``, and ``--tls-cert`` to present)."""

    def __init__(self, timeout: float = 5.0, tls: TlsFiles | None = None) -> None:
        self.timeout = timeout
        self.tls = tls

    def _call(self, address: str, tls: bool, method: str, request: object) -> RouterStates:
        if tls and self.tls is None:
            raise RouterUnreachable(f"{address}: the router serves TLS and the operator has no --tls-ca")
        try:
            with open_channel(address, self.tls if tls else None) as channel:
                stub = admin_pb2_grpc.AdminStub(channel)
                return _states(getattr(stub, method)(request, timeout=self.timeout))
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise RouterUnreachable(f"{address}: {method} failed: {code}: {detail}") from exc

    def get_ranks(self, address: str, tls: bool = False) -> RouterStates:
        return self._call(address, tls, "GetRanks", admin_pb2.GetRanksRequest())

    def set_ranks(self, address: str, ranks: Sequence[RouterRank], tls: bool = False) -> RouterStates:
        request = admin_pb2.SetRanksRequest(ranks=[
            admin_pb2.RankSpec(rank=r.rank, address=r.address, draining=r.draining) for r in ranks])
        return self._call(address, tls, "SetRanks", request)
