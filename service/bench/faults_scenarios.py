"""Three of the fault bench's scenarios: engines SIGKILLed under load and restarted, then the router
SIGKILLed while its engines live on (both on the engines of ``shared_cluster``, which the slow-loris
scenario of ``faults_loris`` uses next), and a KV pool too small for the load (``kv_cluster``)."""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from .faults_cluster import Cluster
from .faults_tally import REFUSALS, Background, Tally, Workload, memory, send, tally

if TYPE_CHECKING:
    from .faults import FaultsConfig


@dataclass(frozen=True)
class Kill:
    rank: int
    seconds_to_gone: float  # from the SIGKILL until the router finds the rank GONE
    seconds_to_ready: float  # until the restarted engine's rank is READY again


class KillStorm:
    """A thread that, every ``interval`` seconds, SIGKILLs a random READY engine while another stays
    READY, and restarts it on a thread of its own the way a pod comes back under the operator: once
    the router has found the rank GONE (its requests moved on), the rank leaves the table; the engine
    starts again at its address and the rank is offered again (``Admin.SetRanks``), joins, is READY.
    ``stop`` ends the kills and waits for the restarts under way."""

    def __init__(self, cluster: Cluster, interval: float, rng: random.Random) -> None:
        self.cluster, self.interval, self.rng = cluster, interval, rng
        self.kills: list[Kill] = []
        self._lock = threading.Lock()  # guards the sets, and orders the SetRanks calls
        self._offered = set(range(len(cluster.engines)))  # the router's table
        self._killable = set(self._offered)  # READY, and no kill of it under way
        self._restarts: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kill-storm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if len(self._killable) < 2:  # one engine stays READY
                    continue
                rank = self.rng.choice(sorted(self._killable))
                self._killable.discard(rank)
            killed = time.monotonic()
            self.cluster.engines[rank].kill()
            restart = threading.Thread(target=self._restart, args=(rank, killed), name=f"restart-{rank}", daemon=True)
            restart.start()
            self._restarts.append(restart)

    def _restart(self, rank: int, killed: float) -> None:
        try:
            self.cluster.wait_state(rank, "GONE")
            gone = time.monotonic()
            self._offer(rank, False)
            self.cluster.engines[rank].start()
            self._offer(rank, True)
            self.cluster.wait_state(rank, "READY")
            with self._lock:
                self._killable.add(rank)
                self.kills.append(Kill(rank, gone - killed, time.monotonic() - killed))
        except BaseException as exc:  # re-raised by stop()
            self._errors.append(exc)

    def _offer(self, rank: int, offered: bool) -> None:
        with self._lock:
            (self._offered.add if offered else self._offered.discard)(rank)
            self.cluster.set_ranks(self._offered)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for restart in self._restarts:
            restart.join()
        if self._errors:
            raise RuntimeError(f"the kill storm failed: {self._errors[0]}") from self._errors[0]


def engine_argv(cfg: FaultsConfig, kv_cache_tokens: int, max_running_requests: int) -> tuple[str, ...]:
    return ("--model", cfg.model, "--grace-period", "1", "--page-size", str(cfg.page_size),
            "--kv-cache-tokens", str(kv_cache_tokens), "--max-running-requests", str(max_running_requests))


def kv_for(work: Workload, page_size: int) -> int:
    """A pool that holds every stream of ``work`` at once, with its longest prompt."""
    longest = max(len(p) for p in work.prompts) + work.new_tokens + page_size
    return work.concurrency * longest + 4 * page_size


def shared_cluster(cfg: FaultsConfig, works: list[Workload]) -> Cluster:
    """The engines the kill storm, the router restart and the loris run on, one after the other: each
    with KV and running slots for all their streams at once (the loris's too), round-robin dispatch."""
    loris = cfg.loris_streams * (max(len(w.prompts[0]) for w in works) + cfg.loris_new_tokens + cfg.page_size)
    engine = engine_argv(cfg, max(kv_for(w, cfg.page_size) for w in works) + loris,
                         max(w.concurrency for w in works) + cfg.loris_streams)
    return Cluster(cfg.engines, engine, ("--dispatch", "round-robin", "--grace-period", "1"), cfg.env)


def engine_kill_storm(cfg: FaultsConfig, cluster: Cluster, work: Workload) -> dict[str, Any]:
    """The load goes on until the last restarted engine has rejoined (streams also meet a joining rank)."""
    start = cluster.rss_mib()
    load = Background(cluster.router.address, work, "kill")
    storm = KillStorm(cluster, cfg.kill_interval, random.Random(cfg.seed))
    try:
        time.sleep(cfg.seconds)
    finally:
        try:
            storm.stop()
        finally:
            sent = load.finish()
    end, states = cluster.rss_mib(), list(cluster.rank_states().values())
    return {**tally(sent).summary(), "num_engines": cfg.engines, "kills": len(storm.kills),
            "killed_ranks": [k.rank for k in storm.kills],
            "rejoin": "found GONE, left out of the table, restarted at its address, offered again (Admin.SetRanks, "
                      "as the operator does); at most num_engines - 1 down at once",
            "kill_to_gone_seconds_max": _max(k.seconds_to_gone for k in storm.kills),
            "kill_to_ready_seconds_max": _max(k.seconds_to_ready for k in storm.kills),
            "ranks_at_end": states, "memory": memory(start, end),
            "memory_note": "engines: the processes alive at each end (a killed engine restarts as a new one)"}


def _max(values: Iterable[float]) -> float | None:
    return round(max(values), 2) if (values := list(values)) else None


def kv_cluster(cfg: FaultsConfig, work: Workload) -> Cluster:
    """The KV storm's engine (a pool of ``--kv-cache-tokens``) and router (``--kv-max-queued``, and no
    prefix cache, so that the tokens computed beyond each request's own, prompt + output - 1, are the
    ones recomputed after preemption)."""
    engine = engine_argv(cfg, cfg.kv_cache_tokens, work.concurrency)
    router = ("--max-queued-requests", str(cfg.kv_max_queued), "--no-enable-prefix-cache", "--grace-period", "1")
    return Cluster(1, engine, router, cfg.env)


def kv_exhaustion_storm(cfg: FaultsConfig, cluster: Cluster, work: Workload) -> dict[str, Any]:
    start, computed = cluster.rss_mib(), _computed_tokens(cluster)
    sent = send(cluster.router.address, work, "kv", cfg.seconds)
    end, computed = cluster.rss_mib(), _computed_tokens(cluster) - computed
    t = tally(sent)
    needed = sum(len(_prompt(work, r.request_id)) + len(r.token_ids) - 1 for r, ref in sent
                 if ref is not None and r.token_ids == ref)
    oversized = sum(ref is None for _, ref in sent)
    return {**t.summary(), "kv_pool_tokens": cfg.kv_cache_tokens, "max_queued_requests": cfg.kv_max_queued,
            "oversized_prompts_sent": oversized, "computed_tokens": computed,
            "recomputed_tokens": computed - needed if t.completed_exact + sum(t.refused.values()) == t.sent else None,
            "memory": memory(start, end)}


def _computed_tokens(cluster: Cluster) -> int:
    return sum(s.tokens for s in cluster.mode_stats().values())


def _prompt(work: Workload, rid: str) -> list[int]:
    """The prompt of request ``LABEL-N`` (``send`` sends prompt N of the pool, modulo its size)."""
    return work.prompts[int(rid.rsplit("-", 1)[1]) % len(work.prompts)]


def router_restart(cfg: FaultsConfig, cluster: Cluster, work: Workload) -> dict[str, Any]:
    """One load throughout, its channels kept open: streams in flight when the router dies are lost
    (their state was the router's), calls while it is away get UNAVAILABLE (and retry), and once a new
    router serves at the same address over the same engines, the channels reconnect. The load goes on
    for at least half the scenario's time after the new router is up."""
    start, steps, engines = cluster.rss_mib(), _decode_steps(cluster), [e.pid for e in cluster.engines]
    began = time.monotonic()
    load = Background(cluster.router.address, work, "restart")
    try:
        _wait_decoding(cluster, steps + 5, load)
        killed = time.monotonic()
        cluster.router.kill()
        cluster.router.start()
        back = time.monotonic()
        time.sleep(max(0.0, max(began + cfg.seconds, back + cfg.seconds / 2) - time.monotonic()))
    finally:
        sent = load.finish()
    end = cluster.rss_mib()
    survived = [e.pid for e in cluster.engines] == engines and all(e.alive for e in cluster.engines)
    # reconnected: the first call after the kill that a router served (a channel's backoff is 1 s at most;
    # the other channels may take that long again)
    reconnected = min((r.start for r, _ in sent if r.start >= killed and r.code == "OK"), default=math.inf)
    t = Tally()
    for r, ref in sent:  # a call begun after the kill (a channel not yet back) gets a clear UNAVAILABLE
        t.add(r, ref, REFUSALS | {"UNAVAILABLE"} if r.start >= killed else REFUSALS)
    after = tally([(r, ref) for r, ref in sent if r.start >= reconnected], REFUSALS | {"UNAVAILABLE"})
    return {**t.summary(), "lost_expected": True,
            "lost_note": "streams in flight at the router's SIGKILL end: their state was the router's",
            "in_flight_at_kill": sum(r.start < killed <= r.end for r, _ in sent),
            "router_restart_seconds": round(back - killed, 2),
            "reconnect": "the same client channels, to a new router at the same address",
            "reconnect_seconds": round(reconnected - back, 2) if reconnected < math.inf else None,
            "after_restart": {"requests_sent": after.sent, "completed_exact": after.completed_exact,
                              "refused": dict(after.refused), "lost": after.lost},
            "engines_survived": survived, "memory": memory(start, end)}


def _decode_steps(cluster: Cluster) -> int:
    stat = cluster.mode_stats().get("DECODE")
    return stat.steps if stat is not None else 0


def _wait_decoding(cluster: Cluster, steps: int, load: Background, timeout: float = 60.0) -> None:
    """Until the router has run ``steps`` DECODE steps (streams are mid-way), unless the load ended."""
    deadline = time.monotonic() + timeout
    while _decode_steps(cluster) < steps and load.is_alive():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router ran fewer than {steps} decode steps in {timeout:.0f}s")
        time.sleep(0.02)
