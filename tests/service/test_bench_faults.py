"""``modeserve bench faults``: how a stream is judged against its reference, and each scenario run
for a few seconds on CPU (real router and engine processes): nothing lost or duplicated where the
service promises it, the router restart's losses counted, loris-free streams exact."""

from __future__ import annotations

import json
from typing import Any

import pytest

from modeserve.service.bench.faults_tally import REFUSALS, Tally, outcome
from modeserve.service.bench.load_client import StreamResult
from tests.service.test_cli import modeserve

REF = [7, 8, 8, 9]


def result(tokens: list[int], code: str = "OK") -> StreamResult:
    return StreamResult("r", code, 0.0, 1.0, token_ids=tokens)


@pytest.mark.parametrize(("tokens", "code", "expect"), [
    (REF, "OK", "exact"),
    ([7, 8, 8, 8, 9], "OK", "diverged"),  # a token sent twice
    ([7, 8, 9, 9], "OK", "diverged"),  # one left out
    ([7, 8], "OK", "lost"),  # ended early ("abort")
    ([7, 8], "UNAVAILABLE", "lost"),
    ([], "UNAVAILABLE", "lost"),
    ([], "RESOURCE_EXHAUSTED", "refused"),
    ([7], "RESOURCE_EXHAUSTED", "other"),  # a refusal after a token is not a clean one
    ([7, 8], "INTERNAL", "other"),
])
def test_outcome_against_the_reference(tokens: list[int], code: str, expect: str) -> None:
    assert outcome(result(tokens, code), REF) == expect


def test_a_prompt_that_never_fits_must_be_refused_as_invalid() -> None:
    assert outcome(result([], "INVALID_ARGUMENT"), None) == "refused"
    assert outcome(result([], "RESOURCE_EXHAUSTED"), None) == "other"
    assert outcome(result([1, 2]), None) == "other"
    assert outcome(result([], "UNAVAILABLE"), REF, REFUSALS | {"UNAVAILABLE"}) == "refused"


def test_tally_counts_duplicated_tokens_and_adds_up() -> None:
    t = Tally()
    for tokens, code in [(REF, "OK"), ([7, 8, 8, 8, 9], "OK"), ([], "RESOURCE_EXHAUSTED"), ([7], "CANCELLED")]:
        t.add(result(tokens, code), REF)
    s = t.summary()
    assert s["duplicated_tokens"] == 2 and s["diverged_streams"] == 1  # [8, 9] past the divergence
    assert (s["completed_exact"], s["refused"], s["lost"]) == (1, {"RESOURCE_EXHAUSTED": 1}, 1)
    assert s["status_codes"] == {"CANCELLED": 1, "OK": 2, "RESOURCE_EXHAUSTED": 1} and s["requests_sent"] == 4


@pytest.fixture(scope="module")
def scenarios() -> dict[str, dict[str, Any]]:
    """One run of every scenario, a few seconds of load each (the kill storm, the router restart and
    the loris share three engines; the KV storm has one of its own)."""
    proc = modeserve("bench", "faults", "--seconds-per-scenario", "3", "--kill-interval", "0.5", "--concurrency", "6",
                     "--new-tokens", "24", "--loris-streams", "16", "--loris-new-tokens", "256", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "faults" and r["seconds_per_scenario"] == 3
    out: dict[str, dict[str, Any]] = r["scenarios"]
    assert set(out) == {"engine_kill_storm", "kv_exhaustion_storm", "router_restart", "slow_loris"}
    for s in out.values():  # every stream is counted once
        parts = s["completed_exact"] + sum(s["refused"].values()) + s["lost"] + s["diverged_streams"]
        assert parts + sum(s["other_errors"].values()) == s["requests_sent"] == sum(s["status_codes"].values()), s
    return out


def no_loss(s: dict[str, Any]) -> None:
    assert s["completed_exact"] > 0, s
    assert s["lost"] == 0 and s["diverged_streams"] == 0 and s["duplicated_tokens"] == 0, s
    assert s["other_errors"] == {}, s


@pytest.mark.slow
def test_engine_kill_storm_loses_and_repeats_nothing(scenarios: dict[str, dict[str, Any]]) -> None:
    s = scenarios["engine_kill_storm"]
    no_loss(s)
    assert s["num_engines"] == 3 and s["kills"] >= 1 and s["ranks_at_end"] == ["READY"] * 3, s
    assert s["completed_exact"] + sum(s["refused"].values()) == s["requests_sent"]


@pytest.mark.slow
def test_kv_exhaustion_storm_preempts_and_refuses_clearly(scenarios: dict[str, dict[str, Any]]) -> None:
    s = scenarios["kv_exhaustion_storm"]
    no_loss(s)
    assert s["oversized_prompts_sent"] > 0 and s["refused"]["INVALID_ARGUMENT"] == s["oversized_prompts_sent"]
    assert set(s["refused"]) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
    assert s["recomputed_tokens"] > 0, s  # preempted requests were prefilled again, and still came out exact


@pytest.mark.slow
def test_router_restart_counts_the_streams_it_lost(scenarios: dict[str, dict[str, Any]]) -> None:
    s = scenarios["router_restart"]
    assert s["lost_expected"] and 1 <= s["lost"] <= s["in_flight_at_kill"], s
    assert s["diverged_streams"] == 0 and s["duplicated_tokens"] == 0 and s["other_errors"] == {}, s
    assert set(s["refused"]) <= {"UNAVAILABLE"} and s["engines_survived"], s
    after = s["after_restart"]  # served by the new router on the same channels
    assert after["lost"] == 0 and after["completed_exact"] > 0, s
    assert after["completed_exact"] + after["refused"].get("UNAVAILABLE", 0) == after["requests_sent"], s


@pytest.mark.slow
def test_slow_loris_leaves_other_streams_exact_and_memory_bounded(scenarios: dict[str, dict[str, Any]]) -> None:
    s = scenarios["slow_loris"]
    no_loss(s)
    assert s["completed_exact"] == s["requests_sent"] and s["loris_streams_opened"] == 16, s
    assert s["baseline"]["completed_exact"] == s["baseline"]["requests_sent"] > 0
    assert s["latency_under_loris"]["itl_ms_p50"] > 0 and s["baseline"]["itl_ms_p50"] > 0
    # 16 unread streams of 256 tokens (top-20 logprobs each) cost the router well under 64 MiB
    assert s["memory"]["router"]["peak_mib"] - s["memory"]["router"]["start_mib"] < 64, s["memory"]
