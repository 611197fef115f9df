"""Rank 0's side of a tensor-parallel engine: it starts a process for each other rank, joins them in
one ``TpGroup`` and, when the engine closes, tells them to stop. A rank that dies takes the engine
out: rank 0's process exits, so that whatever serves it (an engine pod) is seen dead, as any dead
engine is, and the router's failover takes over."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from typing import Any

import torch

from ..python_child import python_argv
from .group import TpGroup, tp_store

logger = logging.getLogger(__name__)
HOST = "127.0.0.1"  # the ranks of one engine share a host (a pod)
WORKER = "modeserve.engine.distributed.worker"


class TpWorkers:
    def __init__(self, model: str, kwargs: dict[str, Any], size: int, device: torch.device,
                 exit_on_loss: bool = True, worker: str = WORKER) -> None:
        """``kwargs``: the engine arguments (JSON values). ``exit_on_loss``: a rank's death ends this
        process (engine servers); False: it is logged and the next collective fails (tests). ``worker``:
        the module each other rank runs. A rank that exits before all have joined is a ``RuntimeError``
        at once (not after the join's timeout)."""
        store = tp_store(0, size, HOST, 0)  # bound before the ranks learn its port: no other process can take it
        self.procs = [subprocess.Popen(python_argv("-m", worker, json.dumps(
            {"model": model, "kwargs": kwargs, "rank": rank, "host": HOST, "port": store.port})))
            for rank in range(1, size)]
        self._closing = False
        try:
            self.group = self._join(size, store, device)
        except BaseException:
            self._kill()
            raise
        for proc in self.procs:
            threading.Thread(target=self._watch, args=(proc, exit_on_loss), daemon=True,
                             name=f"tp-rank-watch-{proc.pid}").start()

    def _join(self, size: int, store: torch.distributed.TCPStore, device: torch.device) -> TpGroup:
        """Rank 0's group, built while the other ranks join; refused as soon as one of them exits (the
        join, on a daemon thread, stays blocked until its store times out)."""
        done: list[TpGroup | BaseException] = []

        def join() -> None:
            try:
                done.append(TpGroup(0, store, size, device))
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                done.append(exc)

        thread = threading.Thread(target=join, daemon=True, name="tp-join")
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            lost = [(rank, proc.returncode) for rank, proc in enumerate(self.procs, 1) if proc.poll() is not None]
            if lost and thread.is_alive():
                raise RuntimeError(f"tensor-parallel rank {lost[0][0]} exited with {lost[0][1]} before the ranks "
                                   "joined (its error is on stderr)")
        if isinstance(done[0], BaseException):
            raise done[0]
        return done[0]

    def _watch(self, proc: subprocess.Popen[bytes], exit_on_loss: bool) -> None:
        code = proc.wait()
        if self._closing:
            return
        logger.error("tensor-parallel rank (pid %d) exited with %s: the engine is out", proc.pid, code)
        if exit_on_loss:
            os._exit(70)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the other ranks (after the step in flight) and wait for them; kill what is left."""
        if self._closing:
            return
        self._closing = True
        try:
            if all(proc.poll() is None for proc in self.procs):  # else a rank is lost and the group with it
                self.group.send_step(None)
                for proc in self.procs:
                    proc.wait(timeout)
        except (RuntimeError, subprocess.TimeoutExpired):
            logger.warning("tensor-parallel ranks did not stop cleanly: killed", exc_info=True)
        finally:
            self._kill()

    def _kill(self) -> None:
        self._closing = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
