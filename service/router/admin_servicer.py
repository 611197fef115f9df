"""``modeserve.v1.Admin``: set and read the router's DP ranks (the operator's handle on the router)."""

from __future__ import annotations

import grpc

from ...proto.v1 import admin_pb2, admin_pb2_grpc
from .rank_table import RankSpec, RankTable

ADMIN_SERVICE = "modeserve.v1.Admin"


def ranks_to_proto(table: RankTable) -> admin_pb2.RanksStatus:
    return admin_pb2.RanksStatus(ranks=table.status())


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, table: RankTable) -> None:
        self.table = table

    async def SetRanks(self, request: admin_pb2.SetRanksRequest,
                       context: grpc.aio.ServicerContext) -> admin_pb2.RanksStatus:
        specs = []
        for i, r in enumerate(request.ranks):
            if r.rank < 0 or not r.address:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ranks[{i}]: needs rank >= 0 and an address")
            specs.append(RankSpec(r.rank, r.address, r.draining))
        try:
            self.table.set_ranks(specs)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return ranks_to_proto(self.table)

    async def GetRanks(self, request: admin_pb2.GetRanksRequest,
                       context: grpc.aio.ServicerContext) -> admin_pb2.RanksStatus:
        return ranks_to_proto(self.table)
