"""What a TARGET_VERIFY step costs against a DECODE step, on random weights of a named shape: at each
batch size, the same requests (``--input-len`` prompts) decode plainly, then verify k drafts a step
for each k, in one engine. Every verifying request carries exactly k drafts (a fixed proposal
in place of prompt lookup, so the step's shape is the one measured whatever the model says); random
weights reject them, so each step emits one token and the context grows as a decode's does.

The step time is wall time over the steps of a run, host work included; with overlap a request's next
verify step is built while its last one runs (chained rows, drafted on the device), as in serving.
Verify steps replay CUDA graphs of their k (captured anew for each k). From the costs: the batch-1 tok/s that an acceptance length of 3 (two
drafts kept, then the target's token) would give at each k, against plain decoding's."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from typing import Any

import torch

from ...engine.request import Req
from ...engine.sampling_params import SamplingParams
from ...engine.scheduler.speculative import NgramDrafter
from ...engine.scheduler.speculative_scheduler import SpeculativeScheduler
from .batch import add_batch, engine_kwargs, model_folder, prefill, random_prompts
from .host_phases import run_timed
from .limits import device_name, sync
from .profile import profile_steps

ACCEPTANCE_LENGTH = 3


class FixedDrafter(NgramDrafter):
    """k drafts for every request (token 3 repeated), as many as it has room for."""

    def propose(self, req: Req) -> list[int]:
        return [3] * max(self.room(req), 0)


def step_ms(llm: Any, prompts: list[list[int]], steps: int,
            profile: list[dict[str, Any]] | None = None) -> tuple[float, float, dict[str, float]]:
    """Mean wall ms of the steps until each of ``prompts`` has ``steps`` more tokens (the device synced at
    both ends; the loop times a step from its launch, which leaves an eager step's launch out), the
    drafts a verify step carried per request, and the host's µs a step by phase (``host_phases``; not
    under ``profile``). Given ``profile``, those steps run under ``torch.profiler`` and their device time
    by kernel is appended to it."""
    k = llm.scheduler.drafter.k if llm.scheduler.drafter is not None else 0
    # room for k drafts to the end of the timed steps; the rest aborted
    reqs = add_batch(llm, prompts, SamplingParams(temperature=0.0, max_new_tokens=steps + k + 2, ignore_eos=True))
    prefill(llm, reqs)
    stats = llm.scheduler.stats
    counts = stats.mode_counts
    n0, d0, v0 = sum(counts.values()), stats.spec_draft_tokens, stats.mode_requests["TARGET_VERIFY"]
    sync(llm.runner.device)
    start = time.perf_counter()
    until = lambda: all(len(r.output_ids) > steps for r in reqs)  # noqa: E731
    phases: dict[str, float] = {}
    if profile is None:
        phases = run_timed(llm, until).per_step_us()
    else:
        profile.append(profile_steps(llm, lambda: llm.run_until(until)))
    sync(llm.runner.device)
    for r in reqs:
        llm.abort(r.rid)
    ms = (time.perf_counter() - start) * 1e3 / max(sum(counts.values()) - n0, 1)
    return ms, (stats.spec_draft_tokens - d0) / max(stats.mode_requests["TARGET_VERIFY"] - v0, 1), phases


def _profiles(llm: Any, prompts: list[list[int]], k: int, steps: int) -> dict[str, Any]:
    """Where the smallest batch's steps go: a decode run and a verify run of ``k`` drafts (the graphs
    of the last k measured are the ones captured) under ``torch.profiler``, and each linear layer
    timed alone at k+1 rows (cuBLAS, as a verify step runs it) against its roofline."""
    from .limits import measure_roofline
    from .linear import linear_report

    sched = llm.scheduler
    profiles: list[dict[str, Any]] = []
    drafter, sched.drafter = sched.drafter, None
    step_ms(llm, prompts, steps, profiles)
    sched.drafter = drafter
    step_ms(llm, prompts, steps, profiles)
    decode, verify = profiles
    out = {"batch_size": len(prompts), "k": k, "decode": decode, "verify": verify}
    if llm.runner.device.type == "cuda":
        roof = measure_roofline(llm.runner)
        out["linear_at_verify_rows"] = linear_report(llm.runner.model, len(prompts) * (k + 1), roof.bandwidth,
                                                     roof.flops)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ...engine.llm import LLM

    if args.tensor_parallel_size > 1:  # it captures verify graphs anew on the runner, which other ranks would not
        raise ValueError("bench verify runs one rank (--tensor-parallel-size 1)")
    tmp = tempfile.TemporaryDirectory()
    folder, load_format = model_folder(args, tmp.name)
    top_bs, k_max = max(args.batch_sizes), max(args.ks)
    llm = LLM(model=folder, load_format=load_format, **engine_kwargs(args), page_size=16,
              max_running_requests=top_bs, speculative_algorithm="ngram", speculative_num_steps=k_max,
              kv_cache_tokens=top_bs * (args.input_len + args.output_len + k_max + 32) + 64,
              max_context_len=args.input_len + args.output_len + k_max + 16)
    sched, vocab = llm.scheduler, llm.model_config.vocab_size
    assert isinstance(sched, SpeculativeScheduler)  # speculative_algorithm is set
    prompts = {bs: random_prompts(vocab, bs, args.input_len, seed=bs).tolist() for bs in args.batch_sizes}
    decode: dict[int, float] = {}
    verify: dict[int, dict[int, float]] = {bs: {} for bs in args.batch_sizes}
    drafts: dict[int, dict[int, float]] = {bs: {} for bs in args.batch_sizes}
    host: dict[int, dict[str, Any]] = {bs: {} for bs in args.batch_sizes}  # µs a step by phase
    sched.drafter = None
    for bs in args.batch_sizes:
        step_ms(llm, prompts[bs], 8)  # warm: graphs of this bucket, first-use costs
        decode[bs], _, host[bs]["decode"] = step_ms(llm, prompts[bs], args.output_len)
        host[bs]["verify"] = {}
    for k in args.ks:
        llm.runner.capture_verify_graphs(k + 1)  # k drafts a request: the verify graphs of that shape
        sched.drafter = FixedDrafter(dataclasses.replace(sched.cfg, speculative_num_steps=k), sched.max_context)
        for bs in args.batch_sizes:
            step_ms(llm, prompts[bs], 4)
            verify[bs][k], drafts[bs][k], host[bs]["verify"][k] = step_ms(llm, prompts[bs], args.output_len)
    profiles = _profiles(llm, prompts[min(args.batch_sizes)], args.ks[-1], args.profile_steps) if args.profile_steps else None
    rows = [{
        "batch_size": bs, "decode_step_ms": round(decode[bs], 4),
        "verify_step_ms": {k: round(v, 4) for k, v in verify[bs].items()},
        "verify_vs_decode": {k: round(v / decode[bs], 3) for k, v in verify[bs].items()},
        "drafts_per_request_step": {k: round(d, 3) for k, d in drafts[bs].items()},
        "host_us_per_step": host[bs],
        # output tok/s at acceptance length 3 (only k >= 2 can keep two drafts), and as a ratio to plain decoding's
        "plain_tok_s": round(bs * 1e3 / decode[bs], 1),
        "projected_tok_s_at_acceptance_3": {k: round(ACCEPTANCE_LENGTH * bs * 1e3 / v, 1)
                                            for k, v in verify[bs].items() if k >= ACCEPTANCE_LENGTH - 1},
        "projected_speedup_at_acceptance_3": {k: round(ACCEPTANCE_LENGTH * decode[bs] / v, 3)
                                              for k, v in verify[bs].items() if k >= ACCEPTANCE_LENGTH - 1},
    } for bs in args.batch_sizes]
    graphs = llm.runner.verify_graphs
    out = {"bench": "verify", "shape": args.model or args.shape, "device": device_name(torch.device(args.device)),
           "dtype": str(llm.runner.dtype).removeprefix("torch."), "attention_backend": llm.runner.attention_backend_name,
           "cuda_graph": llm.runner.graphs is not None, "verify_graph_buckets": graphs.buckets if graphs else [],
           "verify_graph_replays": dict(graphs.hits) if graphs else {}, "input_len": args.input_len,
           "steps": args.output_len, "results": rows}
    if profiles is not None:
        out["profiles"] = profiles
    tmp.cleanup()
    return out
