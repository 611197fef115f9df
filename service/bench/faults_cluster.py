"""The fault bench's processes: ``modeserve engine`` and ``modeserve router`` children on loopback at
ports chosen here, so that a killed one comes back at the same address; their resident memory read
from ``/proc``; the router's rank table read and set through its Admin API, as the operator does when
a pod goes and comes back."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

import grpc

from ...proto.v1 import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc
from ...engine.python_child import python_argv
from ..rpc.engine_process import read_address, stop_process
from .servers import rss_mib

START_TIMEOUT = 120.0


@dataclass
class Child:
    """``modeserve <argv> --host 127.0.0.1 --port PORT``, started and killed at will. An engine gets
    ``--exit-on-stdin-eof`` and a stdin pipe: it cannot outlive this process."""

    argv: tuple[str, ...]
    env: dict[str, str]
    port: int = 0  # 0 until the first start binds one; a restart binds the same
    proc: subprocess.Popen[str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        engine = self.argv[0] == "engine"
        argv = [*python_argv("-m", "modeserve.service.cli"), *self.argv, "--host", "127.0.0.1",
                "--port", str(self.port), *(["--exit-on-stdin-eof"] if engine else [])]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if engine else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, text=True, env=self.env)
        try:
            self.port = int(read_address(self.proc, self.argv[0], START_TIMEOUT).rsplit(":", 1)[1])
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone (its port free again)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, grace=10.0)
        self._close_pipes()

    def _close_pipes(self) -> None:
        assert self.proc is not None
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def rss_mib(self) -> float:
        return rss_mib(self.pid) if self.proc is not None else 0.0


class Cluster:
    """Engine processes (rank i: ``engine_argv`` + ``--dp-rank i``) and one router over them
    (``router_argv`` added to its flags); a context manager that starts and stops them all."""

    def __init__(self, num_engines: int, engine_argv: Sequence[str], router_argv: Sequence[str],
                 env: dict[str, str]) -> None:
        self.engines = [Child(("engine", *engine_argv, "--dp-rank", str(r)), env) for r in range(num_engines)]
        self.router = Child(("router",), env)  # its flags once the engines are bound (their ports known)
        self._router_argv = tuple(router_argv)

    def start(self) -> None:
        """The engines at once, each on a port of its own choosing, then the router over their addresses;
        on an error, all stopped again. (A port picked here and bound later could be another child's by
        then: a bench that started two clusters at once once had its KV storm's router describe an engine
        of the other cluster.)"""
        try:
            with ThreadPoolExecutor(len(self.engines)) as pool:
                list(pool.map(Child.start, self.engines))
            self.router.argv = ("router", "--engines", ",".join(e.address for e in self.engines), "--no-http",
                                *self._router_argv)
            self.router.start()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with ThreadPoolExecutor(len(self.engines) + 1) as pool:  # each gets its grace period at once
            list(pool.map(Child.stop, (self.router, *self.engines)))

    def rss_mib(self) -> dict[str, float]:
        """The router's resident memory and the engines' together."""
        return {"router": round(self.router.rss_mib(), 1),
                "engines": round(sum(e.rss_mib() for e in self.engines), 1)}

    def rank_states(self) -> dict[int, str]:
        """The router's rank table (``Admin.GetRanks``): rank -> READY, JOINING, GONE, ..."""
        with grpc.insecure_channel(self.router.address) as channel:
            ranks = admin_pb2_grpc.AdminStub(channel).GetRanks(admin_pb2.GetRanksRequest(), timeout=10).ranks
        return {r.rank: admin_pb2.RankState.Name(r.state).removeprefix("RANK_STATE_") for r in ranks}

    def wait_state(self, rank: int, state: str, timeout: float = 60.0) -> None:
        """Until the router reports ``rank`` in ``state`` (``TimeoutError`` after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while (states := self.rank_states()).get(rank) != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} not {state} after {timeout:.0f}s: {states}")
            time.sleep(0.05)

    def set_ranks(self, ranks: Iterable[int]) -> None:
        """Give the router the table of these ranks at their engines' addresses (``Admin.SetRanks``, the
        operator's call): a rank left out is removed, one added joins."""
        specs = [admin_pb2.RankSpec(rank=r, address=self.engines[r].address) for r in sorted(ranks)]
        with grpc.insecure_channel(self.router.address) as channel:
            admin_pb2_grpc.AdminStub(channel).SetRanks(admin_pb2.SetRanksRequest(ranks=specs), timeout=10)

    def mode_stats(self) -> dict[str, generate_pb2.ModeStat]:
        """The router's forward steps per mode, over all its ranks (``ModelInfo``)."""
        with grpc.insecure_channel(self.router.address) as channel:
            info = generate_pb2_grpc.GenerateStub(channel).ModelInfo(generate_pb2.ModelInfoRequest(), timeout=10)
        return {s.mode: s for s in info.mode_stats}
