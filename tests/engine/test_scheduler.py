"""Scheduler policy without a model: modes per step, chunking, mixing, admission, preemption,
stop conditions, abort. A fake engine answers each sampled row with a token from a script."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from modeserve.engine.config import SchedulerConfig
from modeserve.engine.forward_batch import ForwardResult
from modeserve.engine.forward_mode import ForwardMode
from modeserve.engine.request import Req
from modeserve.engine.sampling_params import SamplingParams
from modeserve.engine.scheduler.create import create_scheduler
from modeserve.engine.scheduler.scheduled_step import ScheduledStep
from modeserve.engine.scheduler.scheduler import Scheduler

VOCAB = 100
EOS = 2


def make(num_pages: int = 64, page_size: int = 4, max_context: int = 256, **cfg: object) -> Scheduler:
    return create_scheduler(SchedulerConfig(**cfg), num_pages=num_pages, page_size=page_size,
                            max_context=max_context, vocab_size=VOCAB, eos_token_ids=(EOS,),
                            decode=lambda ids: "".join(chr(65 + i % 26) for i in ids))


def add(s: Scheduler, n: int, rid: str, **sp: object) -> Req:
    params = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True, **sp})
    req = s.make_request(rid, list(range(10, 10 + n)), params)
    s.add_request(req)
    return req


def run_step(s: Scheduler, token: int = 50) -> ScheduledStep:
    step = s.schedule()
    assert step is not None
    s.process_result(step, ForwardResult(np.full(step.batch.num_samples, token, dtype=np.int64)))
    return step


def check_batch_invariants(step: ScheduledStep) -> None:
    b = step.batch
    assert b.num_tokens == int(b.extend_lens.sum()) == len(b.positions) == len(b.out_cache_loc)
    assert len(set(b.out_cache_loc.tolist())) == b.num_tokens  # no slot written twice
    assert 0 not in b.out_cache_loc.tolist()  # page 0 is reserved


def test_prefill_then_decode_modes_and_stats() -> None:
    s = make()
    a, b = add(s, 5, "a"), add(s, 9, "b")
    first = run_step(s)
    assert first.batch.forward_mode == ForwardMode.EXTEND and first.batch.extend_lens.tolist() == [5, 9]
    assert first.batch.positions.tolist() == list(range(5)) + list(range(9))
    second = run_step(s)
    assert second.batch.forward_mode == ForwardMode.DECODE
    assert second.batch.prefix_lens.tolist() == [5, 9] and second.batch.input_ids.tolist() == [50, 50]
    while s.has_work:
        check_batch_invariants(run_step(s))
    assert a.finish_reason == b.finish_reason == "length" and len(a.output_ids) == 4
    stats = s.stats.get_stats()
    assert stats["mode_distribution"] == {"EXTEND": 1, "DECODE": 3}
    assert stats["tokens_by_mode"] == {"EXTEND": 14, "DECODE": 6}
    assert s.kv.pool.num_free_pages + (s.kv.cache.num_cached_pages if s.kv.cache else 0) == s.kv.pool.num_total_pages


def test_chunked_prefill_splits_long_prompt_and_only_last_chunk_samples() -> None:
    s = make(chunked_prefill_size=4)
    add(s, 10, "a")
    steps = [run_step(s) for _ in range(3)]
    assert [st.batch.extend_lens.tolist() for st in steps] == [[4], [4], [2]]
    assert [st.batch.sample_mask.tolist() for st in steps] == [[False], [False], [True]]
    assert all(st.batch.forward_mode == ForwardMode.EXTEND for st in steps)
    assert run_step(s).batch.forward_mode == ForwardMode.DECODE


def test_mixed_step_caps_prefill_share() -> None:
    s = make(chunked_prefill_size=64, enable_mixed=True, max_prefill_ratio=0.5, enable_prefix_cache=False)
    for i in range(3):
        add(s, 3, f"d{i}", max_new_tokens=20)
    run_step(s)  # EXTEND of the three
    add(s, 30, "long")
    step = run_step(s)
    assert step.batch.forward_mode == ForwardMode.MIXED
    num_prefill = int(step.batch.extend_lens[0])
    assert step.batch.extend_lens.tolist()[1:] == [1, 1, 1]
    assert num_prefill == 3  # ratio 0.5 with 3 decodes: prefill tokens <= 3
    assert num_prefill / step.batch.num_tokens <= 0.5


def test_without_mixed_prefill_runs_alone() -> None:
    s = make(enable_mixed=False)
    add(s, 3, "a", max_new_tokens=10)
    run_step(s)
    add(s, 6, "b")
    step = run_step(s)
    assert step.batch.forward_mode == ForwardMode.EXTEND and step.batch.extend_lens.tolist() == [6]


def test_max_running_requests_limits_admission() -> None:
    s = make(max_running_requests=2)
    for i in range(3):
        add(s, 4, f"r{i}")
    step = run_step(s)
    assert step.batch.batch_size == 2 and len(s.waiting) == 1


def test_preemption_when_kv_runs_out_and_everything_finishes() -> None:
    s = make(num_pages=9, page_size=4, enable_prefix_cache=False)  # 8 usable pages = 32 tokens
    reqs = [add(s, 7, f"r{i}", max_new_tokens=12) for i in range(3)]
    for _ in range(200):
        if not s.has_work:
            break
        check_batch_invariants(run_step(s))
    assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in reqs)
    assert s.stats.num_retractions > 0
    assert s.kv.pool.num_free_pages == s.kv.pool.num_total_pages


@pytest.mark.parametrize("kind", ["eos", "stop_token", "stop_string", "ignore_eos"])
def test_stop_conditions(kind: str) -> None:
    s = make()
    sp: dict[str, object] = {"max_new_tokens": 10, "ignore_eos": kind == "ignore_eos"}
    if kind == "stop_token":
        sp["stop_token_ids"] = [77]
    if kind == "stop_string":
        sp["stop"] = ["ZZ"]  # decode maps 77 -> 'Z'
    req = add(s, 3, "a", **sp)
    token = EOS if kind in ("eos", "ignore_eos") else 77
    for _ in range(20):
        if not s.has_work:
            break
        run_step(s, token)
    if kind == "ignore_eos":
        assert req.finish_reason == "length" and len(req.output_ids) == 10
    elif kind == "stop_string":
        assert req.finish_reason == "stop" and len(req.output_ids) == 2 and req.matched_stop == "ZZ"
    else:
        assert req.finish_reason == "stop" and len(req.output_ids) == 1


def test_abort_waiting_and_running_frees_everything() -> None:
    s = make(max_running_requests=1, enable_prefix_cache=False)
    a, b = add(s, 5, "a", max_new_tokens=50), add(s, 5, "b")
    run_step(s)
    assert s.abort("b") is b and b.finish_reason == "abort"
    assert s.abort("a") is a and a.finish_reason == "abort"
    assert s.abort("missing") is None
    assert not s.has_work and s.schedule() is None
    assert s.kv.pool.num_free_pages == s.kv.pool.num_total_pages and len(s.free_slots) == 1


def test_one_log_line_per_step(caplog: pytest.LogCaptureFixture) -> None:
    s = make()
    add(s, 5, "a", max_new_tokens=2)
    with caplog.at_level(logging.INFO, logger="modeserve.engine.scheduler.scheduler"):
        run_step(s)
        run_step(s)
    lines = [r.getMessage() for r in caplog.records if "mode=" in r.getMessage()]
    assert len(lines) == 2
    assert "mode=EXTEND batch_size=1 num_tokens=5" in lines[0] and "mode=DECODE batch_size=1 num_tokens=1" in lines[1]
    # the running totals come from ForwardModeStats, the same numbers /metrics and Describe report
    assert "EXTEND steps=1 tokens=5" in lines[0] and "DECODE steps=1 tokens=1" in lines[1]


def test_prefix_cache_hit_is_sent_to_engine_once() -> None:
    s = make(page_size=4)
    add(s, 13, "a", max_new_tokens=1)
    while s.has_work:
        run_step(s)
    b = add(s, 13, "b", max_new_tokens=1)
    step = run_step(s)
    assert step.batch.prefix_lens.tolist() == [12] and step.batch.extend_lens.tolist() == [1]
    (upd,) = step.batch.slot_updates
    assert upd.start == 0 and len(upd.kv_locs) == 12 and b.num_cached_prompt_tokens == 12


def test_idle_step_when_a_lockstep_rank_has_no_work() -> None:
    s = make()
    assert s.schedule() is None
    step = s.schedule(idle_if_empty=True)
    assert step is not None and step.batch.forward_mode == ForwardMode.IDLE
    assert step.batch.batch_size == 0 and step.batch.num_tokens == 0
    assert s.process_result(step, ForwardResult(np.zeros(0, dtype=np.int64))) == []
    add(s, 3, "a", max_new_tokens=1)
    assert s.schedule(idle_if_empty=True).batch.forward_mode == ForwardMode.EXTEND  # type: ignore[union-attr]
    assert s.stats.get_stats()["mode_distribution"] == {"IDLE": 1, "EXTEND": 1}
