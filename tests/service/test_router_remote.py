"""``modeserve router`` + separate ``modeserve engine`` processes, through real gRPC clients."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from modeserve.engine.config import SchedulerConfig
from modeserve.service.rpc.client import GenerateClient
from modeserve.service.router.remote import RemoteRouterConfig, start_remote_router
from tests.engine.tiny_models import COMMON, mixed_prompts
from tests.service.test_serve import exact_streams, generate_all, reference, wait_idle


def spawn(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", *args], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}"


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[str]]:
    procs = [spawn("engine", "--model", str(tiny_model), "--host", "127.0.0.1", "--port", "0", "--page-size", "4",
                   "--kv-cache-tokens", "2048", "--dp-rank", str(rank)) for rank in range(2)]
    yield [addr for _, addr in procs]
    for proc, _ in procs:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("num_engines", [1, 2])
def test_64_streams_over_remote_engines_equal_llm_generate(engines: list[str], tiny_model: Path,
                                                            num_engines: int) -> None:
    app = start_remote_router("127.0.0.1:0", engines[:num_engines], None, RemoteRouterConfig(
        SchedulerConfig(chunked_prefill_size=32, enable_mixed=True, max_prefill_ratio=0.5)))
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        prompts = mixed_prompts(64, COMMON["vocab_size"], seed=8, max_len=40)
        exact_streams(client, tiny_model, prompts, 8)
        assert client.model_info().num_ranks == num_engines
        steps = [loop.scheduler.stats.get_stats()["mode_distribution"] for loop in app.loops]
        assert all(s.get("DECODE", 0) > 0 for s in steps)  # every engine took work
    finally:
        client.close()
        app.stop(grace=1)


def test_ngram_speculative_streams_over_a_remote_engine_equal_llm_generate(engines: list[str],
                                                                          tiny_model: Path) -> None:
    """The router's scheduler proposes n-gram drafts, the remote engine verifies them (TARGET_VERIFY
    over the wire: the accepted lengths come back in the ForwardResult)."""
    app = start_remote_router("127.0.0.1:0", engines[:1], None, RemoteRouterConfig(
        SchedulerConfig(chunked_prefill_size=32, speculative_algorithm="ngram")))
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        prompts = [p * 3 for p in mixed_prompts(32, COMMON["vocab_size"], seed=9, max_len=12)]  # repeats: drafts
        outs = generate_all(client, prompts, 16)
        assert [o.token_ids for o in outs] == reference(tiny_model, prompts, 16)
        stats = app.loops[0].scheduler.stats.get_stats()
        assert stats["mode_distribution"].get("TARGET_VERIFY", 0) > 0
        assert stats["speculative"]["accepted_tokens"] > 0
    finally:
        client.close()
        app.stop(grace=1)


def test_draft_model_speculative_streams_over_a_remote_engine_equal_llm_generate(tiny_model: Path) -> None:
    """The draft model lives in the engine process: the router's scheduler reserves k drafts a
    request, the remote engine drafts and verifies them in one step (no round trip per draft token)."""
    proc, addr = spawn("engine", "--model", str(tiny_model), "--host", "127.0.0.1", "--port", "0", "--page-size", "4",
                       "--kv-cache-tokens", "2048", "--speculative-algorithm", "draft",
                       "--speculative-draft-model", str(tiny_model))
    app = start_remote_router("127.0.0.1:0", [addr], None, RemoteRouterConfig(
        SchedulerConfig(chunked_prefill_size=32, speculative_algorithm="draft")))
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        prompts = mixed_prompts(32, COMMON["vocab_size"], seed=10, max_len=24)
        outs = generate_all(client, prompts, 16)
        assert [o.token_ids for o in outs] == reference(tiny_model, prompts, 16)
        stats = app.loops[0].scheduler.stats.get_stats()
        assert stats["mode_distribution"].get("TARGET_VERIFY", 0) > 0 and stats["mode_distribution"]["DRAFT_EXTEND"] > 0
        assert stats["speculative"]["accepted_tokens"] > 0  # the target drafting for itself: all kept
    finally:
        client.close()
        app.stop(grace=1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_router_command(engines: list[str], tiny_model: Path) -> None:
    proc, addr = spawn("router", "--engines", engines[0], "--host", "127.0.0.1", "--port", "0", "--no-http")
    client = GenerateClient(addr)
    try:
        prompt = [5, 9, 11, 13]
        out = client.generate(token_ids=prompt, max_new_tokens=6, ignore_eos=True)
        assert out.token_ids == reference(tiny_model, [prompt], 6)[0]
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_split_prefill_streams_over_a_remote_engine_equal_llm_generate(engines: list[str], tiny_model: Path) -> None:
    """The router's scheduler sends a long prompt's prefill a layer a step (SPLIT_PREFILL over the wire,
    the layer range in the batch) between the decode steps of the others; the engine keeps the hidden
    state between them; every stream equals ``LLM.generate`` and the KV pool is idle afterwards."""
    app = start_remote_router("127.0.0.1:0", engines[:1], None, RemoteRouterConfig(
        SchedulerConfig(chunked_prefill_size=64, enable_split_prefill=True, split_prefill_min_tokens=24,
                        split_prefill_token_budget=24)))
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        prompts = mixed_prompts(24, COMMON["vocab_size"], seed=10, max_len=60)
        exact_streams(client, tiny_model, prompts, 12)
        stats = app.loops[0].scheduler.stats.get_stats()
        assert stats["mode_distribution"].get("SPLIT_PREFILL", 0) >= 2
        wait_idle(app)
    finally:
        client.close()
        app.stop(grace=1)


def test_block_diffusion_streams_over_a_remote_engine_equal_llm_generate(tmp_path: Path) -> None:
    """An SDAR-shaped model behind a remote engine: the router's scheduler denoises each block (DLLM_EXTEND
    over the wire, the chosen tokens' probabilities back in the ForwardResult) and streams it committed."""
    from modeserve.engine import LLM, SamplingParams
    from tests.engine.test_dllm import PROMPTS, make_sdar

    folder, _ = make_sdar(tmp_path / "sdar", 4)
    want = [o.token_ids for o in LLM(model=str(folder), page_size=4, attention_backend="torch").generate(
        prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))]
    proc, addr = spawn("engine", "--model", str(folder), "--host", "127.0.0.1", "--port", "0", "--page-size", "4",
                       "--kv-cache-tokens", "2048", "--attention-backend", "torch")
    app = start_remote_router("127.0.0.1:0", [addr], None, RemoteRouterConfig(SchedulerConfig()))
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        outs = generate_all(client, PROMPTS, 10)
        assert [o.token_ids for o in outs] == want
        assert set(app.loops[0].scheduler.stats.get_stats()["mode_distribution"]) == {"DLLM_EXTEND"}
        assert all(o.num_messages <= 4 for o in outs)  # a message a committed block (and the end)
    finally:
        client.close()
        app.stop(grace=1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_tensor_parallel_engine_streams_equal_llm_generate(tiny_model: Path) -> None:
    """A remote engine of two tensor-parallel ranks (``--tensor-parallel-size 2``: the engine process is
    rank 0 and starts rank 1): streams equal one rank's ``LLM.generate``; SIGTERM stops both ranks."""
    proc, addr = spawn("engine", "--model", str(tiny_model), "--host", "127.0.0.1", "--port", "0", "--page-size", "4",
                       "--kv-cache-tokens", "2048", "--tensor-parallel-size", "2")
    (rank1,) = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    app = start_remote_router("127.0.0.1:0", [addr], None, RemoteRouterConfig(
        SchedulerConfig(chunked_prefill_size=32, enable_mixed=True, max_prefill_ratio=0.5)))
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        exact_streams(client, tiny_model, mixed_prompts(24, COMMON["vocab_size"], seed=31, max_len=40), 12)
        wait_idle(app)
    finally:
        client.close()
        app.stop(grace=1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not Path(f"/proc/{rank1}").exists() or "zombie" in Path(f"/proc/{rank1}/status").read_text()
