"""Prometheus /metrics of the router and of an engine, read with prometheus_client's own parser: per
forward mode, the engine's counts equal the router's (one source each: ForwardModeStats), and
request metrics count what the clients saw."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from modeserve.engine.config import EngineConfig, SchedulerConfig
from modeserve.engine.models.loader import open_checkpoint
from modeserve.engine.runner.model_runner import ModelRunner
from modeserve.service.rpc.client import GenerateClient
from modeserve.service.rpc.engine_server import create_engine_server
from modeserve.service.router.remote import RemoteRouterConfig, start_remote_router
from modeserve.service.rpc.engine_client import describe_engine
from tests.engine.tiny_models import COMMON, mixed_prompts
from tests.service.test_serve import generate_all

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def by_mode(samples: Samples, name: str, **fixed: str) -> dict[str, float]:
    return {dict(k)["mode"]: v for (n, k), v in samples.items()
            if n == name and all(dict(k).get(a) == b for a, b in fixed.items())}


@pytest.fixture
def engine_and_router(tiny_model: Path):  # type: ignore[no-untyped-def]
    cfg = EngineConfig.from_kwargs(model=str(tiny_model), page_size=4, kv_cache_tokens=2048)
    runner = ModelRunner(cfg.runner, open_checkpoint(tiny_model))
    engine = create_engine_server(runner, "127.0.0.1:0", model_path=str(tiny_model), dp_rank=0, metrics_port=0)
    app = start_remote_router("127.0.0.1:0", [f"127.0.0.1:{engine.port}"], None, RemoteRouterConfig(
        SchedulerConfig(chunked_prefill_size=32, enable_mixed=True, max_prefill_ratio=0.5), metrics_port=0))
    yield engine, app
    app.stop(grace=1)
    engine.stop(1)


def test_router_and_engine_metrics_agree_by_mode(engine_and_router) -> None:  # type: ignore[no-untyped-def]
    engine, app = engine_and_router
    client = GenerateClient(f"127.0.0.1:{app.port}")
    prompts = mixed_prompts(12, COMMON["vocab_size"], seed=41, max_len=60)
    outs = generate_all(client, prompts, 6)
    router, eng = scrape(app.metrics.port), scrape(engine.metrics.port)
    steps_r = by_mode(router, "modeserve_forward_steps_total", dp_rank="0")
    steps_e = by_mode(eng, "modeserve_forward_steps_total", dp_rank="0")
    stats = app.loops[0].scheduler.stats.get_stats()
    assert steps_r == steps_e == {m: float(n) for m, n in stats["mode_distribution"].items()}
    assert steps_r.get("DECODE", 0) > 0 and steps_r.get("EXTEND", 0) + steps_r.get("MIXED", 0) > 0
    assert by_mode(router, "modeserve_forward_tokens_total") == by_mode(eng, "modeserve_forward_tokens_total")
    # histograms: one observation per step, +Inf bucket = count
    count_e = by_mode(eng, "modeserve_forward_step_seconds_count")
    assert count_e == steps_e
    inf = {dict(k)["mode"]: v for (n, k), v in eng.items() if n == "modeserve_forward_step_seconds_bucket"
           and dict(k)["le"] == "+Inf"}
    assert inf == count_e
    # request metrics: what the clients saw
    assert router["modeserve_requests_total", (("finish_reason", "length"),)] == len(prompts)
    assert router["modeserve_time_to_first_token_seconds_count", ()] == len(prompts)
    assert all(o.finish_reason == "length" for o in outs)
    assert router["modeserve_queue_requests", (("dp_rank", "0"),)] == 0
    assert router["modeserve_running_requests", (("dp_rank", "0"),)] == 0
    assert 0 <= router["modeserve_kv_cache_usage_ratio", (("dp_rank", "0"),)] <= 1
    # Describe and ModelInfo read the same statistics
    _, desc = describe_engine(f"127.0.0.1:{engine.port}", 5)
    assert {m.mode: m.steps for m in desc.mode_stats} == {m: int(v) for m, v in steps_e.items()}
    info = client.model_info()
    assert {m.mode: m.steps for m in info.mode_stats} == {m: int(v) for m, v in steps_r.items()}
    client.close()


def test_speculative_metrics_count_what_the_streams_carried(tiny_model: Path) -> None:
    """n-gram drafting behind a router (overlap off, so no token is computed and then dropped): the
    drafts and kept drafts are counted, and every streamed token is a prefill's first token, a DECODE
    step's or one of the acceptance-length histogram's (its sum)."""
    from tests.engine.test_speculative import PROMPTS

    cfg = EngineConfig.from_kwargs(model=str(tiny_model), page_size=4, kv_cache_tokens=4096)
    engine = create_engine_server(ModelRunner(cfg.runner, open_checkpoint(tiny_model)), "127.0.0.1:0",
                                  model_path=str(tiny_model), dp_rank=0, metrics_port=0)
    app = start_remote_router("127.0.0.1:0", [f"127.0.0.1:{engine.port}"], None, RemoteRouterConfig(
        SchedulerConfig(speculative_algorithm="ngram"), overlap=False, metrics_port=0))
    try:
        client = GenerateClient(f"127.0.0.1:{app.port}")
        outs = generate_all(client, PROMPTS, 20)
        client.close()
        router, eng = scrape(app.metrics.port), scrape(engine.metrics.port)
    finally:
        app.stop(grace=1)
        engine.stop(1)
    rank = (("dp_rank", "0"),)
    verify_requests = router["modeserve_spec_acceptance_length_count", rank]
    emitted = router["modeserve_spec_acceptance_length_sum", rank]
    kept = router["modeserve_spec_accepted_tokens_total", rank]
    assert 0 < kept <= router["modeserve_spec_draft_tokens_total", rank]
    assert emitted == kept + verify_requests  # each request of a verify step: its kept drafts and one token
    assert router["modeserve_spec_acceptance_length_bucket", (("dp_rank", "0"), ("le", "+Inf"))] == verify_requests
    assert router["modeserve_spec_acceptance_length_bucket", (("dp_rank", "0"), ("le", "1.0"))] < verify_requests
    decode_tokens = by_mode(router, "modeserve_forward_tokens_total").get("DECODE", 0)
    assert sum(len(o.token_ids) for o in outs) == len(PROMPTS) * 20 == len(PROMPTS) + decode_tokens + emitted
    steps_e = by_mode(eng, "modeserve_forward_steps_total", dp_rank="0")
    assert steps_e["TARGET_VERIFY"] == by_mode(router, "modeserve_forward_steps_total")["TARGET_VERIFY"] > 0


def test_split_prefill_steps_are_counted_by_router_and_engine(tiny_model: Path) -> None:
    """A long prompt arriving while another request decodes runs as SPLIT_PREFILL steps (a layer each);
    the router's and the engine's /metrics count the same steps of the mode."""
    cfg = EngineConfig.from_kwargs(model=str(tiny_model), page_size=4, kv_cache_tokens=4096)
    engine = create_engine_server(ModelRunner(cfg.runner, open_checkpoint(tiny_model)), "127.0.0.1:0",
                                  model_path=str(tiny_model), dp_rank=0, metrics_port=0)
    app = start_remote_router("127.0.0.1:0", [f"127.0.0.1:{engine.port}"], None, RemoteRouterConfig(
        SchedulerConfig(enable_split_prefill=True, split_prefill_min_tokens=40, split_prefill_token_budget=40),
        metrics_port=0))
    try:
        client = GenerateClient(f"127.0.0.1:{app.port}")
        stream = client.stream(token_ids=[5, 6, 7], max_new_tokens=100, ignore_eos=True)
        next(iter(stream))  # decoding
        assert len(client.generate(token_ids=list(range(10, 70)), max_new_tokens=4, ignore_eos=True).token_ids) == 4
        assert sum(len(m.token_ids) for m in stream) > 0
        client.close()
        router, eng = scrape(app.metrics.port), scrape(engine.metrics.port)
    finally:
        app.stop(grace=1)
        engine.stop(1)
    steps_e = by_mode(eng, "modeserve_forward_steps_total", dp_rank="0")
    assert steps_e["SPLIT_PREFILL"] == by_mode(router, "modeserve_forward_steps_total")["SPLIT_PREFILL"] == 2
