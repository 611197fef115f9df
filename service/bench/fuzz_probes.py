"""Sending one fuzz case to a server and judging its answer (shared by the fuzz tests and ``modeserve
bench fuzz``), and the witnesses: requests whose tokens must come out exact while or after fuzzing.

A verdict is ``ok`` (served, and the answer is well formed), ``refused`` (a clear INVALID_ARGUMENT or an
OpenAI-style 4xx error body) or ``other`` (anything else: the finding a fuzz run looks for). Request
bytes that do not parse are INVALID_ARGUMENT too (``rpc.undecodable`` for single requests, the engine
server for a Forward stream's batch).
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from typing import Any, Callable, Literal, NamedTuple, Sequence

import grpc
import numpy as np

from ...engine.config import SchedulerConfig
from ...engine.request import Req
from ...engine.sampling_params import SamplingParams
from ...engine.scheduler.create import create_scheduler
from ...engine.scheduler.scheduler import Scheduler
from ...proto.v1 import engine_pb2, engine_pb2_grpc, forward_pb2, generate_pb2, generate_pb2_grpc
from ..rpc.batch_checks import BatchLimits
from ..rpc.convert import batch_to_proto
from ..rpc.grpc_executor import GrpcExecutor, TransportError

Verdict = Literal["ok", "refused", "other"]
HTTP_REFUSALS = {400, 404, 405, 413}


class Reply(NamedTuple):
    verdict: Verdict
    status: str  # "OK", a gRPC status name or "HTTP 400"
    detail: str = ""


def _rpc_reply(err: grpc.RpcError) -> Reply:
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT and details:
        return Reply("refused", code.name, details)
    return Reply("other", code.name, details)


def http_reply(base: str, path: str, data: bytes, timeout: float = 60.0) -> Reply:
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return Reply("ok" if resp.status == 200 else "other", f"HTTP {resp.status}")
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read()
    except OSError as err:  # refused, reset or timed out: the server is down or hangs
        return Reply("other", "CONNECT", repr(err))
    try:
        error = json.loads(body)["error"]
        well_formed = bool(error["message"]) and set(error) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        well_formed = False
    verdict: Verdict = "refused" if status in HTTP_REFUSALS and well_formed else "other"
    return Reply(verdict, f"HTTP {status}", body[:300].decode(errors="replace"))


def generate_reply(channel: grpc.Channel, request: generate_pb2.GenerateRequest, timeout: float = 60.0) -> Reply:
    try:
        for _ in generate_pb2_grpc.GenerateStub(channel).Generate(request, timeout=timeout):
            pass
    except grpc.RpcError as err:
        return _rpc_reply(err)
    return Reply("ok", "OK")


def _num_samples(m: forward_pb2.ForwardBatch) -> int:
    """Rows a result must carry: every token of a verify step, else the requests with sample_mask set."""
    if m.forward_mode == forward_pb2.FORWARD_MODE_TARGET_VERIFY:
        return len(m.input_ids) // 8
    return int(np.count_nonzero(np.frombuffer(m.sample_mask, dtype="u1")))


def forward_reply(channel: grpc.Channel, batches: Sequence[forward_pb2.ForwardBatch], vocab_size: int,
                  timeout: float = 30.0) -> Reply:
    """``batches`` on one new Forward stream: ok when a well-formed result comes back for each (its step,
    one token in [0, vocab) per sampling row), refused when the stream ends INVALID_ARGUMENT after the
    results of the batches before the bad one."""
    results: list[forward_pb2.ForwardResult] = []
    try:
        for r in engine_pb2_grpc.EngineStub(channel).Forward(iter(batches), timeout=timeout):
            results.append(r)
        reply = Reply("ok", "OK") if len(results) == len(batches) else Reply(
            "other", "OK", f"{len(results)} results for {len(batches)} batches")
    except grpc.RpcError as err:
        reply = _rpc_reply(err)
    for batch, result in zip(batches, results):
        ids = np.frombuffer(result.next_token_ids, dtype="<i8")
        in_vocab = bool(((ids >= 0) & (ids < vocab_size)).all())
        if result.step != batch.step or ids.shape[0] != _num_samples(batch) or not in_vocab:
            return Reply("other", reply.status, f"bad result {result} for step {batch.step}")
    return reply


def raw_reply(address: str, data: bytes, timeout: float = 1.0) -> Reply:
    """``data`` on a new TCP connection, then read until the server closes it or ``timeout``; the
    server is judged by what it does next (serves the witness, answers health), not by this reply."""
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as err:
        return Reply("other", "CONNECT", repr(err))
    with sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # no more bytes: the server answers and closes, or times out
            while sock.recv(65536):
                pass
        except OSError:  # reset or timed out: the server's choice
            pass
    return Reply("ok", "OK")


def garbage_reply(channel: grpc.Channel, methods: dict[str, str], path: str, payloads: Sequence[bytes],
                  timeout: float = 30.0) -> Reply:
    """``payloads`` as the raw request bytes of method ``path`` (``methods[path]``: unary_unary,
    unary_stream or stream_stream). A stream of requests is read to its end and must have one answer
    each (Forward, ServerReflectionInfo); a stream of responses to one request (Generate, Health.Watch:
    they may go on) is cancelled after its first message."""
    kind = methods[path]
    try:
        if kind == "unary_unary":
            channel.unary_unary(path)(payloads[0], timeout=timeout)
        elif kind == "stream_stream":
            answers = len(list(channel.stream_stream(path)(iter(payloads), timeout=timeout)))
            if answers != len(payloads):
                return Reply("other", "OK", f"{answers} answers to {len(payloads)} requests")
        else:
            call = channel.unary_stream(path)(payloads[0], timeout=timeout)
            next(call, None)
            call.cancel()
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.CANCELLED:
            return _rpc_reply(err)
    return Reply("ok", "OK")


# ---- witnesses ------------------------------------------------------------------------------------
class StalledError(RuntimeError):
    """A scheduler with unfinished requests and no step to run."""


def batch_limits(desc: engine_pb2.EngineDescription) -> BatchLimits:
    """What the engine of ``desc`` lets a batch index (the bounds the fuzzed values straddle)."""
    return BatchLimits(max_reqs=desc.max_running_requests, max_context=desc.max_context_len,
                       num_kv_slots=desc.num_kv_slots, vocab_size=desc.vocab_size,
                       num_layers=desc.num_layers)


def engine_scheduler(desc: engine_pb2.EngineDescription, **cfg: object) -> Scheduler:
    """A scheduler sized from an engine's Describe, as a router's rank makes one."""
    config = SchedulerConfig(max_running_requests=desc.max_running_requests, **cfg)  # type: ignore[arg-type]
    return create_scheduler(config, num_pages=desc.num_kv_slots // desc.page_size, page_size=desc.page_size,
                     max_context=desc.max_context_len, vocab_size=desc.vocab_size,
                     eos_token_ids=tuple(desc.eos_token_ids), num_layers=desc.num_layers)


def drive(channel: grpc.Channel, sched: Scheduler, reqs: Sequence[Req]) -> list[forward_pb2.ForwardBatch]:
    """Run ``reqs`` to their end on one Forward stream, a step at a time; the batches it sent."""
    executor = GrpcExecutor(channel)
    sent = []
    try:
        for req in reqs:
            sched.add_request(req)
        while not all(r.finished for r in reqs):
            step = sched.schedule()
            if step is None:
                raise StalledError(f"the scheduler has no step for unfinished requests {[r.rid for r in reqs]}")
            sent.append(batch_to_proto(step.batch))
            sched.process_result(step, executor.launch(step.batch).result())
    finally:
        executor.close()
    return sent


def engine_greedy(channel: grpc.Channel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` from a fresh scheduler over a new Forward stream."""
    sched = engine_scheduler(engine_pb2_grpc.EngineStub(channel).Describe(engine_pb2.DescribeRequest(), timeout=30))
    req = sched.make_request("witness", list(prompt), SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                                     ignore_eos=True))
    drive(channel, sched, [req])
    return list(req.output_ids)


def valid_batches(channel: grpc.Channel) -> list[forward_pb2.ForwardBatch]:
    """Real batches of every mode a scheduler sends: chunked EXTEND, MIXED and DECODE steps with
    admissions (greedy, sampled with penalties and logprobs) and a prefix-cache slot update, then
    n-gram TARGET_VERIFY steps."""
    desc = engine_pb2_grpc.EngineStub(channel).Describe(engine_pb2.DescribeRequest(), timeout=30)
    sched = engine_scheduler(desc, chunked_prefill_size=8, enable_mixed=True, max_prefill_ratio=0.5)
    prompt = [(7 * i + 3) % desc.vocab_size for i in range(12)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    sampled = greedy.replace(temperature=0.8, seed=7, logprobs=2, frequency_penalty=0.5, repetition_penalty=1.2)
    sent = drive(channel, sched, [sched.make_request("a", prompt, greedy)])
    sent += drive(channel, sched, [sched.make_request("b", prompt[:9] + [1, 2], sampled),
                                   sched.make_request("c", prompt[::-1], greedy)])
    spec = engine_scheduler(desc, speculative_algorithm="ngram")
    return sent + drive(channel, spec, [spec.make_request("d", [5, 6, 7] * 4, greedy.replace(max_new_tokens=8))])


def generate_greedy(channel: grpc.Channel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` from a Generate server."""
    request = generate_pb2.GenerateRequest(token_ids=list(prompt), sampling=generate_pb2.SamplingParams(
        max_new_tokens=max_new_tokens, ignore_eos=True))
    return [t for msg in generate_pb2_grpc.GenerateStub(channel).Generate(request, timeout=300) for t in msg.token_ids]


class Witness:
    """``run()`` (a greedy request: ``generate_greedy`` or ``engine_greedy``) again and again on a thread
    until ``finish``; each run must return ``expect``. A run that fails or differs is counted, not raised."""

    def __init__(self, run: Callable[[], list[int]], expect: Sequence[int]) -> None:
        self._run, self.expect = run, list(expect)
        self.runs = self.exact = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fuzz-witness", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.runs += 1
            try:
                got = self._run()
                error = "" if got == self.expect else f"tokens {got} != {self.expect}"
            except (grpc.RpcError, TransportError, StalledError) as err:
                error = repr(err)
            self.exact += not error
            self.failures += [error] if error else []
            if self._stop.is_set():
                return

    def finish(self, timeout: float = 300.0) -> bool:
        """Let the run in flight end; whether every run was exact."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive() and self.runs == self.exact > 0


def tally(replies: Sequence[Reply]) -> dict[str, Any]:
    """Counts of a kind's replies, for the bench's report and the tests' messages."""
    statuses: dict[str, int] = {}
    for r in replies:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    others = [f"{r.status}: {r.detail}"[:300] for r in replies if r.verdict == "other"]
    return {"tried": len(replies), "ok": sum(r.verdict == "ok" for r in replies),
            "refused": sum(r.verdict == "refused" for r in replies), "other": len(others),
            "statuses": dict(sorted(statuses.items())), "other_examples": others[:3]}

