"""The engine gRPC server with a real client: a Scheduler here, the ModelRunner behind Engine.Forward.

Tokens over gRPC equal an in-process ``LLM.generate``; bad batches end only their own stream.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from modeserve.engine.config import EngineConfig
from modeserve.engine.forward_batch import ForwardBatch
from modeserve.engine.forward_mode import ForwardMode
from modeserve.engine.llm import LLM
from modeserve.engine.models.loader import open_checkpoint
from modeserve.engine.request import Req
from modeserve.engine.runner.model_runner import ModelRunner
from modeserve.engine.sampling_params import SamplingParams
from modeserve.engine.scheduler.create import create_scheduler
from modeserve.engine.scheduler.scheduled_step import ScheduledStep
from modeserve.engine.scheduler.scheduler import Scheduler
from modeserve.proto.v1 import engine_pb2, engine_pb2_grpc, forward_pb2
from modeserve.service.rpc.convert import batch_to_proto, result_from_proto
from modeserve.service.rpc.engine_server import ENGINE_SERVICE, EngineServer, create_engine_server
from tests.engine.tiny_models import make_tiny_model, mixed_prompts

ENGINE_KWARGS: dict[str, object] = dict(page_size=4, kv_cache_tokens=1024, max_running_requests=6,
                                        chunked_prefill_size=16, enable_mixed=True, max_prefill_ratio=0.5)
VOCAB = 384
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama3", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    config = EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS)
    return ModelRunner(config.runner, open_checkpoint(model_dir))


@pytest.fixture(scope="module")
def server(runner: ModelRunner, model_dir: Path) -> Iterator[EngineServer]:
    srv = create_engine_server(runner, "127.0.0.1:0", model_path=str(model_dir), dp_rank=3)
    yield srv
    srv.stop(0)


@pytest.fixture(scope="module")
def channel(server: EngineServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(channel)


class ForwardStream:
    """One Engine.Forward stream driven one batch at a time."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._requests: queue.Queue[forward_pb2.ForwardBatch | None] = queue.Queue()
        self._responses = stub.Forward(iter(self._requests.get, None))

    def send(self, msg: forward_pb2.ForwardBatch) -> forward_pb2.ForwardResult:
        self._requests.put(msg)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        assert list(self._responses) == []

    def cancel(self) -> None:
        self._responses.cancel()


def scheduler_for(desc: engine_pb2.EngineDescription) -> Scheduler:
    """A scheduler sized from the engine's Describe, configured like the in-process LLM's."""
    cfg = dataclasses.replace(EngineConfig.from_kwargs(**ENGINE_KWARGS).scheduler,
                              max_running_requests=desc.max_running_requests)
    return create_scheduler(cfg, num_pages=desc.num_kv_slots // desc.page_size, page_size=desc.page_size,
                     max_context=desc.max_context_len, vocab_size=desc.vocab_size,
                     eos_token_ids=tuple(desc.eos_token_ids))


def remote_step(sched: Scheduler, stream: ForwardStream) -> ScheduledStep:
    """``LLM.step`` with the forward over gRPC."""
    step = sched.schedule()
    assert step is not None
    reply = stream.send(batch_to_proto(step.batch))
    assert reply.step == step.batch.step and reply.forward_seconds > 0
    sched.process_result(step, result_from_proto(reply))
    return step


def run_remote(sched: Scheduler, stream: ForwardStream, reqs: list[Req]) -> set[ForwardMode]:
    for r in reqs:
        sched.add_request(r)
    modes = set()
    while not all(r.finished for r in reqs):
        modes.add(remote_step(sched, stream).batch.forward_mode)
    return modes


def workload() -> list[tuple[list[int], SamplingParams]]:
    prompts = mixed_prompts(4, VOCAB, seed=1, min_len=3, max_len=20, shared_prefix=8)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    params = [greedy, greedy.replace(logprobs=2), greedy.replace(temperature=0.8, seed=7), greedy]
    return list(zip(prompts, params))


def test_greedy_and_seeded_tokens_over_grpc_equal_in_process_llm(stub: engine_pb2_grpc.EngineStub,
                                                                 model_dir: Path) -> None:
    work = workload()
    llm = LLM(model=model_dir, **ENGINE_KWARGS)
    want = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0] for p, sp in work[:1]]
    want += llm.generate(prompt_token_ids=[p for p, _ in work[1:]], sampling_params=[sp for _, sp in work[1:]])

    sched = scheduler_for(stub.Describe(engine_pb2.DescribeRequest()))
    stream = ForwardStream(stub)
    reqs = [sched.make_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(work)]
    modes = run_remote(sched, stream, reqs[:1])
    modes |= run_remote(sched, stream, reqs[1:])  # shared prefix: a prefix-cache hit sent as a slot update
    stream.close()

    assert modes == {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED}
    assert [r.output_ids for r in reqs] == [o.token_ids for o in want]
    assert sum(r.num_cached_prompt_tokens for r in reqs) == sum(o.num_cached_tokens for o in want) > 0
    np.testing.assert_allclose(reqs[1].output_logprobs, want[1].logprobs, rtol=1e-5)
    assert [[t for t, _ in top] for top in reqs[1].output_top_logprobs] == \
           [[t for t, _ in top] for top in want[1].top_logprobs]


def first_batch(desc: engine_pb2.EngineDescription) -> forward_pb2.ForwardBatch:
    sched = scheduler_for(desc)
    for i in range(2):
        sched.add_request(sched.make_request(f"x{i}", [5 + i, 6, 7, 8], SamplingParams(temperature=0.0)))
    step = sched.schedule()
    assert step is not None
    return batch_to_proto(step.batch)


def malformed(desc: engine_pb2.EngineDescription) -> dict[str, tuple[forward_pb2.ForwardBatch, str]]:
    cases: dict[str, tuple[forward_pb2.ForwardBatch, str]] = {}
    m = first_batch(desc)
    m.positions = m.positions[:-8]
    cases["wrong_lengths"] = (m, "positions")
    m = first_batch(desc)
    m.req_pool_indices = np.array([0, desc.max_running_requests], dtype="<i8").tobytes()
    cases["slot_out_of_range"] = (m, "req_pool_indices")
    m = first_batch(desc)
    m.forward_mode = 99
    cases["unknown_mode"] = (m, "forward_mode")
    m = first_batch(desc)
    m.forward_mode = forward_pb2.FORWARD_MODE_DRAFT_EXTEND
    cases["draft_extend"] = (m, "DRAFT_EXTEND")
    return cases


def test_bad_batch_ends_only_its_stream(stub: engine_pb2_grpc.EngineStub, model_dir: Path) -> None:
    desc = stub.Describe(engine_pb2.DescribeRequest())
    prompt, sp = workload()[0]
    want = LLM(model=model_dir, **ENGINE_KWARGS).generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
    sched = scheduler_for(desc)
    good = ForwardStream(stub)
    req = sched.make_request("good", prompt, sp)
    sched.add_request(req)
    remote_step(sched, good)  # the good stream is open and has state on the engine
    for name, (msg, field) in malformed(desc).items():
        bad = ForwardStream(stub)
        with pytest.raises(grpc.RpcError) as info:
            bad.send(msg)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert field in (info.value.details() or ""), (name, info.value.details())
        remote_step(sched, good)  # and the good stream keeps working between the bad ones
    while not req.finished:
        remote_step(sched, good)
    good.close()
    assert req.output_ids == want.token_ids
    assert stub.Describe(engine_pb2.DescribeRequest()).vocab_size == VOCAB  # still serving


def test_describe_reports_runner_numbers(stub: engine_pb2_grpc.EngineStub, runner: ModelRunner,
                                         model_dir: Path) -> None:
    d = stub.Describe(engine_pb2.DescribeRequest())
    assert (d.model, d.model_path, d.dp_rank) == (model_dir.name, str(model_dir), 3)
    assert d.num_kv_slots == runner.num_kv_slots and d.num_kv_slots % 4 == 0 and d.num_kv_slots >= 1024
    assert (d.page_size, d.max_running_requests, d.max_context_len, d.vocab_size) == (4, 6, 256, VOCAB)
    assert list(d.eos_token_ids) == [2]
    assert (d.device, d.dtype, d.attention_backend) == ("cpu", "float32", "torch")


def test_health_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", ENGINE_SERVICE):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING, service
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert ENGINE_SERVICE in services and "grpc.health.v1.Health" in services


def test_drain_refuses_new_streams_and_lets_running_ones_finish(runner: ModelRunner) -> None:
    srv = create_engine_server(runner, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            running, dropped = ForwardStream(stub), ForwardStream(stub)
            for stream in (running, dropped):
                assert stream.send(batch_to_proto(ForwardBatch.idle(step=1))).step == 1
            dropped.cancel()  # a client that goes away stops counting
            deadline = time.monotonic() + 5
            while (first := stub.Drain(engine_pb2.DrainRequest())).active_streams > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (first.drained, first.active_streams) == (False, 1)
            with pytest.raises(grpc.RpcError) as info:
                ForwardStream(stub).send(batch_to_proto(ForwardBatch.idle(step=1)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            ready = health.Check(health_pb2.HealthCheckRequest(service=ENGINE_SERVICE)).status
            live = health.Check(health_pb2.HealthCheckRequest(service="")).status
            assert (ready, live) == (health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING)
            assert running.send(batch_to_proto(ForwardBatch.idle(step=2))).step == 2
            running.close()
            second = stub.Drain(engine_pb2.DrainRequest())
            assert (second.drained, second.active_streams) == (True, 0)
    finally:
        srv.stop(0)


def test_stop_waits_for_the_step_in_flight_of_an_open_stream(runner: ModelRunner,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream still open at shutdown, its step running past the grace period: ``stop`` returns once that
    step is done and its thread gone (a step left running in the model while the process exits aborts it)."""
    srv = create_engine_server(runner, "127.0.0.1:0")
    launch, started = runner.launch, threading.Event()

    def slow_launch(batch: ForwardBatch) -> object:
        started.set()
        time.sleep(1.5)
        return launch(batch)

    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            batch = first_batch(stub.Describe(engine_pb2.DescribeRequest()))
            monkeypatch.setattr(runner, "launch", slow_launch)
            requests: queue.Queue[forward_pb2.ForwardBatch | None] = queue.Queue()
            responses = stub.Forward(iter(requests.get, None))
            requests.put(batch)
            assert started.wait(30)
            srv.stop(0.5)  # the step outlasts the grace period
            assert [t for t in threading.enumerate() if t.name == "forward-steps"] == []
            responses.cancel()
    finally:
        srv.stop(0)


def test_engine_command_serves_and_exits_cleanly_on_sigterm(model_dir: Path, tmp_path: Path) -> None:
    stderr = (tmp_path / "stderr.txt").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "modeserve.service.cli", "engine", "--model", str(model_dir), "--host", "127.0.0.1",
         "--port", "0", "--dp-rank", "1", "--grace-period", "2", "--kv-cache-tokens", "256", "--page-size", "4",
         "--max-running-requests", "2"],
        stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        stderr.seek(0)
        match = re.fullmatch(r"modeserve engine listening on 127\.0\.0\.1:(\d+)\n", line)
        assert match, (line, stderr.read())
        with grpc.insecure_channel(f"127.0.0.1:{match.group(1)}") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            desc = stub.Describe(engine_pb2.DescribeRequest())
            assert desc.dp_rank == 1 and desc.max_running_requests == 2
            stream = ForwardStream(stub)
            reply = stream.send(first_batch(desc))
            assert len(result_from_proto(reply).next_token_ids) == 2
            stream.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
