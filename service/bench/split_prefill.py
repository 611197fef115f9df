"""Split prefill against its alternatives: N requests decode at steady state, then a long prompt arrives.
Per scheduling setting (no chunking; chunked prefill at several chunk sizes; MIXED; SPLIT_PREFILL at
several budgets): the decoders' ITL p50/p90/p99 from its arrival to its first token, against the steady ITL
measured just before, and the long prompt's TTFT against its solo prefill (the same prompt on an idle
engine, not chunked). One JSON line per (prompt length, setting), then one per prompt length naming the
settings that meet the goal (p99 ITL <= 1.5x steady and TTFT <= 1.25x solo by default).

One engine per setting runs every prompt length in turn while its decoders keep decoding. The prefix cache
is off (the same prompts recur) and the KV pool holds the decoders' growth over every window beside the
longest prompt: nothing is preempted (checked), and no decoder finishes before a window closes. Before its
measured windows each setting runs ``--warm-windows`` of the shortest prompt, unmeasured: a long-running
server has loaded its MIXED steps' or slices' kernels long before, and the first such step here would
otherwise load them inside the window (one step of ~100 ms sets a p99 of 32 decoders' gaps)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from ...engine.config import RunnerConfig, SchedulerConfig
from ...engine.default_model import default_model_path
from ...engine.models.loader import open_checkpoint
from ...engine.models.model_config import ModelConfig
from ...engine.request import Req
from ...engine.sampling_params import SamplingParams
from .batch import add_batch, engine_kwargs, model_folder, random_prompts
from .limits import device_name, ratio
from .split_prefill_settings import Setting, device_defaults, settings
from .step_times import TimedSteps, gaps_overlapping, gaps_within


class Window(NamedTuple):
    """One long prompt's arrival among the decoders."""

    prompt_len: int
    steady_gaps: list[float]  # the decoders' inter-token gaps just before it arrived, seconds
    gaps: list[float]  # their gaps that overlap [arrival, its first token]
    ttft: float
    first_token: int
    steps: dict[str, int]  # the steps whose result came in that window, by forward mode
    trace: str | None = None  # its torch.profiler trace (--trace-dir)


def _split_slices(budget: int, prompt_len: int, num_layers: int) -> int:
    """SPLIT_PREFILL steps of an unchunked prompt while others decode (``SchedulerConfig``'s rule)."""
    return math.ceil(num_layers / max(1, budget // prompt_len))


def _max_window_steps(s: Setting, prompt_len: int, num_layers: int, num_decoders: int) -> int:
    """A bound on the decode steps from a long prompt's arrival until every decoder has a token after its
    first: what each decoder's KV grows by in one window. Slices beside the decodes leave the decodes their
    own pace while the slices queue on their stream: a wide margin then."""
    chunk = s.params["chunked_prefill_size"] or prompt_len
    r = s.params.get("max_prefill_ratio", 1.0)
    if s.mode == "mixed" and r < 1.0:  # a MIXED step's prefill share, as the scheduler caps it
        chunk = min(chunk, max(1, math.floor(r / (1.0 - r) * num_decoders)))
    slices = _split_slices(s.params["split_prefill_token_budget"], chunk, num_layers) if s.mode == "split_prefill" else 1
    turns = math.ceil(prompt_len / chunk) * slices * s.params.get("split_prefill_decode_steps", 1) + 4
    return turns * (8 if s.params.get("enable_split_prefill_overlap") else 1)


def _sizes(args: argparse.Namespace, s: Setting, mc: ModelConfig, lens: list[int]) -> tuple[dict[str, Any], int]:
    """(the engine's size keywords, the decoders' max_new_tokens): the decoders outlive every window."""
    new = args.warmup_steps + sum(args.steady_steps + 2 + _max_window_steps(s, n, mc.num_layers, args.num_decoders)
                                  for n in lens)
    # a page each: its last page may be part empty, and the scheduler keeps one free per decoder before it
    # admits a prefill beside them (with one prompt length no later window's growth covers those)
    page = RunnerConfig.page_size
    kv = args.num_decoders * (args.decoder_prompt_len + new + 2 * page) + max(lens) + 2 * page
    return {"max_running_requests": args.num_decoders + 1, "kv_cache_tokens": args.kv_cache_tokens or kv,
            "max_context_len": max(max(lens), args.decoder_prompt_len + new) + page}, new


def _one_token(llm: Any, prompt: list[int]) -> Req:
    return llm.make_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))


def _solo(steps: TimedSteps, prompt: list[int]) -> tuple[float, int]:
    """(TTFT, first token) of ``prompt`` on the idle engine."""
    req = _one_token(steps.llm, prompt)
    steps.arrive(req, when=lambda: True)
    steps.run(lambda: req.finished)
    return steps.token_times[req.rid][0] - steps.arrived_at, req.output_ids[0]


def _window(steps: TimedSteps, decoders: list[Req], prompt: list[int], steady_steps: int) -> Window:
    """``steady_steps`` decode steps, then ``prompt`` arrives; until every decoder has a token after its first."""
    times, start, req = steps.token_times, time.perf_counter(), _one_token(steps.llm, prompt)
    steps.arrive(req, when=lambda: all(steps.tokens_since(d.rid, start) > steady_steps for d in decoders))

    def closed() -> bool:
        if any(d.finished for d in decoders):
            raise RuntimeError(f"a decoder finished before the {len(prompt)}-token prompt's window closed "
                               f"(first token {'in' if times[req.rid] else 'not in'}; steps {steps.modes_between(steps.arrived_at)})")
        return req.finished and all(times[d.rid][-1] > times[req.rid][0] for d in decoders)

    steps.run(closed)
    arrived, first = steps.arrived_at, times[req.rid][0]
    return Window(len(prompt), [g for d in decoders for g in gaps_within(times[d.rid], start, arrived)],
                  [g for d in decoders for g in gaps_overlapping(times[d.rid], arrived, first)], first - arrived,
                  req.output_ids[0], steps.modes_between(arrived, first))


@contextlib.contextmanager
def _traced(folder: str | None, name: str, device: torch.device) -> Iterator[str | None]:
    """Profile the block into ``folder``/``name``.json.gz (nothing without a folder); the path."""
    if folder is None:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = str(Path(folder) / f"{name}.json.gz")
    Path(folder).mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        yield path
    prof.export_chrome_trace(path)


def _run_setting(args: argparse.Namespace, s: Setting, model: str | None, load_format: str, mc: ModelConfig,
                 long_prompts: dict[int, list[int]], decoder_prompts: list[list[int]],
                 solo: dict[int, tuple[float, int]]) -> tuple[list[Window], dict[str, Any]]:
    """This setting's windows, and what its engine was (dtype; the SMs of the slices beside the decodes);
    the no-chunking engine fills ``solo`` first."""
    from ...engine.llm import LLM

    warm = [min(long_prompts)] * args.warm_windows
    sizes, new_tokens = _sizes(args, s, mc, warm + list(long_prompts))
    llm = LLM(model=model, load_format=load_format, **engine_kwargs(args), **sizes, enable_prefix_cache=False,
              **s.params)
    steps = TimedSteps(llm)
    _solo(steps, long_prompts[max(long_prompts)])  # warm: first-use costs of the longest prefill stay out
    if s.mode == "no_chunking":
        for n, prompt in long_prompts.items():
            runs = [_solo(steps, prompt) for _ in range(args.solo_repeats)]
            solo[n] = (statistics.median(t for t, _ in runs), runs[0][1])
    decoders = add_batch(llm, decoder_prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens,
                                                              ignore_eos=True))
    steps.run(lambda: all(len(d.output_ids) >= args.warmup_steps for d in decoders))
    for n in warm:  # a server's first MIXED step or slice loads kernels that its later ones find loaded
        _window(steps, decoders, long_prompts[n], args.steady_steps)
    windows = []
    for n, prompt in long_prompts.items():
        with _traced(args.trace_dir, f"{s.label}-{n}", llm.runner.device) as trace:
            windows.append(_window(steps, decoders, prompt, args.steady_steps)._replace(trace=trace))
    if llm.scheduler.stats.num_retractions:
        raise RuntimeError(f"{s.label}: requests were preempted (KV pool of {llm.runner.num_kv_slots} tokens); "
                           "raise --kv-cache-tokens")
    engine: dict[str, Any] = {"dtype": str(llm.runner.dtype).removeprefix("torch.")}
    side = llm.runner.side_stream
    if side is not None and side.slice_sms:  # the driver may round split_prefill_overlap_sms down
        engine["slice_sms"] = side.slice_sms
    return windows, engine


def _row(args: argparse.Namespace, s: Setting, w: Window, solo: tuple[float, int],
         head: dict[str, Any]) -> dict[str, Any]:
    steady = statistics.median(w.steady_gaps)
    p50, p90, p99 = (float(x) for x in np.percentile(w.gaps, [50, 90, 99]))
    itl_ratio, ttft_ratio = p99 / steady, w.ttft / solo[0]
    return {**head, "prompt_len": w.prompt_len, "setting": s.label, "mode": s.mode, "params": s.params,
            "steady_itl_ms": _ms(steady), "itl_p50_ms": _ms(p50), "itl_p50_vs_steady": ratio(p50 / steady),
            # p90 apart from p99: a p99 that one stalled step sets (32 gaps a step) shows as p90 far below it
            "itl_p90_ms": _ms(p90), "itl_p90_vs_steady": ratio(p90 / steady),
            "itl_p99_ms": _ms(p99), "itl_p99_vs_steady": ratio(itl_ratio), "itl_max_ms": _ms(max(w.gaps)),
            "num_gaps": len(w.gaps), "ttft_ms": _ms(w.ttft), "solo_prefill_ms": _ms(solo[0]),
            "ttft_vs_solo": ratio(ttft_ratio), "window_steps": w.steps, "first_token": w.first_token,
            "first_token_matches_solo": w.first_token == solo[1], **({"trace": w.trace} if w.trace else {}),
            "meets_goal": itl_ratio <= args.goal_itl_p99 and ttft_ratio <= args.goal_ttft}


def _summary(args: argparse.Namespace, rows: list[dict[str, Any]], head: dict[str, Any]) -> dict[str, Any]:
    """Per prompt length: the settings that meet the goal, and the split setting nearest to it."""
    splits = [r for r in rows if r["mode"] == "split_prefill"]
    nearest = min(splits, key=lambda r: max(r["itl_p99_vs_steady"] / args.goal_itl_p99,
                                            r["ttft_vs_solo"] / args.goal_ttft), default=None)
    return {**head, "summary": True, "prompt_len": rows[0]["prompt_len"], "solo_prefill_ms": rows[0]["solo_prefill_ms"],
            "steady_itl_ms": round(statistics.median(r["steady_itl_ms"] for r in rows), 3),
            "goal": {"itl_p99_vs_steady_max": args.goal_itl_p99, "ttft_vs_solo_max": args.goal_ttft},
            "meeting_goal": [r["setting"] for r in rows if r["meets_goal"]],
            "split_prefill_meets_goal": any(r["meets_goal"] for r in splits),
            "others_meeting_goal": [r["setting"] for r in rows if r["meets_goal"] and r["mode"] != "split_prefill"],
            "nearest_split": nearest and {k: nearest[k] for k in ("setting", "itl_p99_vs_steady", "ttft_vs_solo")}}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.warm_windows < 0:
        raise ValueError(f"--warm-windows must be >= 0, got {args.warm_windows}")
    defaults = device_defaults(args.device)
    lens = args.prompt_lens or defaults["prompt_lens"]
    with tempfile.TemporaryDirectory() as tmp:
        folder, load_format = (None, "auto") if args.model is None and args.shape is None else model_folder(args, tmp)
        model = str(folder) if folder is not None else None  # None: the embedded default model
        mc = open_checkpoint(model or default_model_path(), load_format).config
        split_min = args.split_min_tokens or min(SchedulerConfig.split_prefill_min_tokens, min(lens))
        long_prompts = {n: random_prompts(mc.vocab_size, 1, n, seed=n)[0].tolist() for n in lens}
        decoder_prompts = random_prompts(mc.vocab_size, args.num_decoders, args.decoder_prompt_len).tolist()
        head: dict[str, Any] = {"bench": "split_prefill", "device": device_name(torch.device(args.device)),
                                "model": args.model or args.shape or "SmolLM2-135M (embedded)",
                                "num_layers": mc.num_layers, "num_decoders": args.num_decoders,
                                "decoder_prompt_len": args.decoder_prompt_len, "warm_windows": args.warm_windows}
        solo: dict[int, tuple[float, int]] = {}
        rows: list[dict[str, Any]] = []
        for s in settings(args, defaults["chunk_sizes"] if args.chunk_sizes is None else args.chunk_sizes,
                          defaults["split_budgets"] if args.split_budgets is None else args.split_budgets, split_min):
            try:
                windows, engine = _run_setting(args, s, model, load_format, mc, long_prompts, decoder_prompts, solo)
            except ValueError as exc:  # a setting this machine refuses (no green contexts) leaves the others
                if s.mode == "no_chunking":
                    raise
                yield {**head, "setting": s.label, "mode": s.mode, "params": s.params, "refused": str(exc)}
                windows, engine = [], {}
            gc.collect()  # the setting's engine goes before the next one is built
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
            for w in windows:
                rows.append(_row(args, s, w, solo[w.prompt_len], {**head, **engine}))
                yield rows[-1]
        for n in lens:
            yield _summary(args, [r for r in rows if r["prompt_len"] == n], {**head, "dtype": rows[0]["dtype"]})
