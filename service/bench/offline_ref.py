"""The offline figures a serving run is compared with, measured in a child process on the same model,
engine arguments and prompts: ``LLM.generate`` of every prompt at once (``bench throughput``'s
measurement) and the decode step of one request (``bench latency``'s: steps back to back)."""

from __future__ import annotations

import multiprocessing
import queue
import time
from typing import Any


def measure(model: str, engine_args: dict[str, Any], prompts: list[list[int]], output_len: int,
            single_prompt: list[int], warm_prompts: list[list[int]], threads: int) -> dict[str, Any]:
    """Output tok/s of ``prompts`` at once, and seconds per decode step of ``single_prompt`` alone,
    after ``warm_prompts`` (4 tokens each, as the servers get) on ``threads`` torch CPU threads."""
    import torch

    torch.set_num_threads(threads)
    from ...engine.llm import LLM
    from ...engine.sampling_params import SamplingParams
    from .batch import add_batch, prefill
    from .limits import sync

    llm = LLM(model=model, **engine_args)
    device = torch.device(llm.runner.device)
    sp = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=warm_prompts, sampling_params=sp.replace(max_new_tokens=4))
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    sync(device)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    reqs = add_batch(llm, [single_prompt], sp)
    prefill(llm, reqs)
    sync(device)
    start = time.perf_counter()
    llm.run_until(lambda: all(r.finished for r in reqs))
    sync(device)
    step = (time.perf_counter() - start) / max(output_len - 1, 1)
    return {"num_prompts": len(prompts), "output_tokens": produced, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(produced / seconds, 1), "decode_step_ms_batch1": round(step * 1e3, 4),
            "steps_by_mode": llm.stats()["mode_distribution"]}


def _child(out: Any, *args: Any) -> None:
    out.put(measure(*args))


def measure_in_child(model: str, engine_args: dict[str, Any], prompts: list[list[int]], output_len: int,
                     single_prompt: list[int], warm_prompts: list[list[int]], threads: int,
                     timeout: float = 3600.0) -> dict[str, Any]:
    """``measure`` in a spawned process: its memory (the device's too) is free again when it returns."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(out, model, engine_args, prompts, output_len, single_prompt, warm_prompts, threads))
    proc.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                result: dict[str, Any] = out.get(timeout=1.0)
                return result
            except queue.Empty:  # still running, unless it died
                if proc.exitcode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"offline reference failed (exit code {proc.exitcode})") from None
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
