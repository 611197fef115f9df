"""Prometheus metrics of a router or an engine, served on ``/metrics`` (``--metrics-port``).

Per-mode step metrics are not counted twice: a collector reads each ``ForwardModeStats`` (the same
object the step log line and the Describe/ModelInfo RPCs read) and the CUDA-graph counters at scrape
time. Request-level metrics (time to first token, inter-token latency, finished requests) are
observed by the router as tokens stream out. Each process owns its registry (no global state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ...engine.scheduler.stats import ForwardModeStats

ACCEPTANCE_LENGTH_MAX = 9  # the acceptance-length histogram's buckets: 1 .. 9 tokens a verify step, then +Inf
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class RankSample:
    """What one DP rank reports at scrape time (router side: its scheduler; engine side: its runner)."""

    rank: str
    stats: ForwardModeStats
    queued: int = 0
    running: int = 0
    kv_usage: float = 0.0
    graph_stats: dict[str, dict[str, int]] | None = None  # CudaGraphRunner.stats()


class StepCollector(Collector):
    """Per-mode counters and histograms from ``ForwardModeStats``, per DP rank, read at scrape time."""

    def __init__(self, samples: Callable[[], Iterable[RankSample]], with_queue: bool) -> None:
        self._samples = samples
        self._with_queue = with_queue

    def collect(self) -> Iterator[Metric]:
        steps = CounterMetricFamily("modeserve_forward_steps", "Forward steps run, by forward mode",
                                    labels=["mode", "dp_rank"])
        tokens = CounterMetricFamily("modeserve_forward_tokens", "Tokens computed by forward steps, by mode",
                                     labels=["mode", "dp_rank"])
        seconds = HistogramMetricFamily("modeserve_forward_step_seconds", "Time of one forward step, by mode",
                                        labels=["mode", "dp_rank"])
        graphs = CounterMetricFamily("modeserve_cuda_graph_replays", "Steps of a CUDA-graph mode: replayed (hit) "
                                     "or run eagerly because no graph fits (miss)", labels=["mode", "hit", "dp_rank"])
        drafts = CounterMetricFamily("modeserve_spec_draft_tokens", "Draft tokens proposed to TARGET_VERIFY steps",
                                     labels=["dp_rank"])
        kept = CounterMetricFamily("modeserve_spec_accepted_tokens", "Draft tokens the target kept",
                                   labels=["dp_rank"])
        lengths = HistogramMetricFamily("modeserve_spec_acceptance_length", "Tokens a TARGET_VERIFY step emitted "
                                        "for one request (kept drafts + 1)", labels=["dp_rank"])
        unmasked = HistogramMetricFamily("modeserve_dllm_unmasked_tokens", "Tokens a DLLM_EXTEND step committed "
                                         "(unmasked) in one request's block", labels=["dp_rank"])
        queue = GaugeMetricFamily("modeserve_queue_requests", "Requests waiting for admission", labels=["dp_rank"])
        running = GaugeMetricFamily("modeserve_running_requests", "Requests running", labels=["dp_rank"])
        kv = GaugeMetricFamily("modeserve_kv_cache_usage_ratio", "KV cache pages in use by running requests",
                               labels=["dp_rank"])
        for s in self._samples():
            st = s.stats
            for mode, n in list(st.mode_counts.items()):
                steps.add_metric([mode, s.rank], n)
                tokens.add_metric([mode, s.rank], st.mode_tokens.get(mode, 0))
            for mode in list(st.mode_time_buckets):
                buckets, _, total = st.step_time_histogram(mode)
                seconds.add_metric([mode, s.rank], [(_le(b), c) for b, c in buckets], total)
            if st.spec_verify_steps:
                drafts.add_metric([s.rank], st.spec_draft_tokens)
                kept.add_metric([s.rank], st.spec_accepted_tokens)
                buckets, total = st.acceptance_histogram(ACCEPTANCE_LENGTH_MAX)
                lengths.add_metric([s.rank], [(_le(b), c) for b, c in buckets], total)
            if st.dllm_unmasked:
                buckets, total = st.dllm_unmasked_histogram()
                unmasked.add_metric([s.rank], [(_le(b), c) for b, c in buckets], total)
            if s.graph_stats is not None:
                for mode, n in s.graph_stats.get("hits", {}).items():
                    graphs.add_metric([mode, "true", s.rank], n)
                for mode, n in s.graph_stats.get("misses", {}).items():
                    graphs.add_metric([mode, "false", s.rank], n)
            if self._with_queue:
                queue.add_metric([s.rank], s.queued)
                running.add_metric([s.rank], s.running)
                kv.add_metric([s.rank], s.kv_usage)
        yield from (steps, tokens, seconds, graphs, drafts, kept, lengths, unmasked)
        if self._with_queue:
            yield from (queue, running, kv)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class RequestMetrics:
    """Router-side request metrics, observed as tokens stream to clients."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram("modeserve_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("modeserve_inter_token_latency_seconds", "Between consecutive streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = Counter("modeserve_requests", "Finished requests, by finish reason", ["finish_reason"],
                                registry=registry)


class MetricsServer:
    """A process's registry and, once ``start``ed, its ``/metrics`` HTTP endpoint."""

    def __init__(self, samples: Callable[[], Iterable[RankSample]], router: bool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StepCollector(samples, with_queue=router))
        self.requests = RequestMetrics(self.registry) if router else None
        self.port: int | None = None
        self.host = ""
        self._server: object = None

    def start(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.host = host
        self.port = int(server.server_port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server = None
