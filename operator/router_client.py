"""The operator's handle on an EngineSet's router: ``modeserve.v1.Admin`` (GetRanks / SetRanks).

``AdminClient`` is the small interface the handlers use, so tests replace the gRPC calls; states are
the ``RankState`` names without their prefix (JOINING, READY, DRAINING, DRAINED, GONE).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import grpc

from .ranks import RouterRank
from .resources import ROUTER_PORT
from ..proto.v1 import admin_pb2, admin_pb2_grpc

RouterStates = dict[int, str]


class RouterUnreachable(Exception):
    """The router did not answer (not started yet, restarting, or the network is down)."""


def router_address(name: str, namespace: str) -> str:
    """The router Service of EngineSet ``name`` (``resources.router_service``)."""
    return f"{name}.{namespace}.svc:{ROUTER_PORT}"


class AdminClient(Protocol):
    def get_ranks(self, address: str) -> RouterStates: ...

    def set_ranks(self, address: str, ranks: Sequence[RouterRank]) -> RouterStates:
        """Replace the router's table with ``ranks``; the router's table afterwards."""
        ...


def _states(reply: admin_pb2.RanksStatus) -> RouterStates:
    return {r.rank: admin_pb2.RankState.Name(r.state).removeprefix("RANK_STATE_") for r in reply.ranks}


class GrpcAdminClient:
    """One short-lived channel per call (a reconcile makes two calls every interval)."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout

    def _call(self, address: str, method: str, request: object) -> RouterStates:
        try:
            with grpc.insecure_channel(address) as channel:
                stub = admin_pb2_grpc.AdminStub(channel)
                return _states(getattr(stub, method)(request, timeout=self.timeout))
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise RouterUnreachable(f"{address}: {method} failed: {code}: {detail}") from exc

    def get_ranks(self, address: str) -> RouterStates:
        return self._call(address, "GetRanks", admin_pb2.GetRanksRequest())

    def set_ranks(self, address: str, ranks: Sequence[RouterRank]) -> RouterStates:
        request = admin_pb2.SetRanksRequest(ranks=[
            admin_pb2.RankSpec(rank=r.rank, address=r.address, draining=r.draining) for r in ranks])
        return self._call(address, "SetRanks", request)
