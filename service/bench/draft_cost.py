"""Speculative decoding with a draft model, end to end at batch 1 on random weights of a named shape
(GPU), beside plain decoding and a verify step of k fixed drafts measured in the same run:

- the target drafting for itself (dummy weights are seeded, so the draft is the same model: every
  draft is the target's own token but for bf16 near-ties between the draft's decode kernels and the
  verify's; the upper bound);
- a draft of another shape (random and unrelated: about no draft kept; what drafting costs).

Per drafter: output tok/s and its ratio to plain decoding's, the acceptance length (tokens a verify
step emits: kept drafts + 1), the speculative step's wall ms (draft catch-up and decode sub-steps,
then the verify), the draft's share of it per draft token ((step - fixed-draft verify step) / k) as a
ratio to the target's decode step, and the tok/s an acceptance length of 3 gives at that step cost."""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ...engine.models.random_checkpoint import write_config_only
from ...engine.sampling_params import SamplingParams
from ...engine.scheduler.speculative_scheduler import SpeculativeScheduler
from .batch import add_batch, engine_kwargs, model_folder, prefill, random_prompts
from .limits import device_name, sync
from .verify_cost import ACCEPTANCE_LENGTH, FixedDrafter, step_ms


def _speculative_run(llm: Any, prompt: list[int], steps: int) -> dict[str, float]:
    """Time ``steps`` new tokens of one request (after its prefill): tok/s, ms per verify step, acceptance length."""
    k = llm.scheduler.cfg.speculative_num_steps
    (req,) = add_batch(llm, [prompt], SamplingParams(temperature=0.0, max_new_tokens=steps + k + 2, ignore_eos=True))
    prefill(llm, [req])
    stats = llm.scheduler.stats
    out0, kept0, verify0 = len(req.output_ids), stats.spec_accepted_tokens, stats.spec_verify_steps
    sync(llm.runner.device)
    start = time.perf_counter()
    llm.run_until(lambda: len(req.output_ids) >= out0 + steps)
    sync(llm.runner.device)
    seconds = time.perf_counter() - start
    tokens, verifies = len(req.output_ids) - out0, max(stats.spec_verify_steps - verify0, 1)
    llm.abort(req.rid)
    return {"tok_s": tokens / seconds, "step_ms": seconds * 1e3 / verifies,
            "acceptance_length": (stats.spec_accepted_tokens - kept0 + verifies) / verifies}


def _free(llm: Any) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ...engine.llm import LLM

    tmp = tempfile.TemporaryDirectory()
    folder, load_format = model_folder(args, tmp.name)
    k = args.k
    common: dict[str, Any] = dict(load_format=load_format, **engine_kwargs(args), page_size=16, max_running_requests=1,
                                  kv_cache_tokens=args.input_len + args.output_len + 4 * k + 64,
                                  max_context_len=args.input_len + args.output_len + 2 * k + 16, speculative_num_steps=k)
    llm = LLM(model=str(folder), speculative_algorithm="ngram", **common)
    prompt = random_prompts(llm.model_config.vocab_size, 1, args.input_len)[0].tolist()
    sched, dtype = llm.scheduler, str(llm.runner.dtype).removeprefix("torch.")
    assert isinstance(sched, SpeculativeScheduler)  # speculative_algorithm is set
    sched.drafter = None
    step_ms(llm, [prompt], 8)  # warm
    decode_ms, _, _ = step_ms(llm, [prompt], args.output_len)
    sched.drafter = FixedDrafter(sched.cfg, sched.max_context)
    step_ms(llm, [prompt], 4)
    verify_ms, _, _ = step_ms(llm, [prompt], args.output_len)
    _free(llm)
    rows = []
    for draft in args.drafts:
        path = folder if draft == "self" else write_config_only(Path(tmp.name) / f"draft-{draft}", draft)
        llm = LLM(model=str(folder), speculative_algorithm="draft", speculative_draft_model=str(path), **common)
        _speculative_run(llm, prompt, 8)  # warm
        r = _speculative_run(llm, prompt, args.output_len)
        draft_ms = (r["step_ms"] - verify_ms) / k
        drafter, verifier = llm.runner.draft, llm.runner.verify_graphs
        rows.append({
            "draft": draft, "tok_s": round(r["tok_s"], 1), "vs_plain_tok_s": round(r["tok_s"] * decode_ms / 1e3, 3),
            "acceptance_length": round(r["acceptance_length"], 3), "step_ms": round(r["step_ms"], 4),
            "step_vs_decode": round(r["step_ms"] / decode_ms, 3), "draft_ms_per_token": round(draft_ms, 4),
            "draft_token_vs_decode_step": round(draft_ms / decode_ms, 3),
            "projected_tok_s_at_acceptance_3": round(ACCEPTANCE_LENGTH * 1e3 / r["step_ms"], 1),
            "projected_speedup_at_acceptance_3": round(ACCEPTANCE_LENGTH * decode_ms / r["step_ms"], 3),
            "draft_graph_replays": dict(drafter.graphs.hits) if drafter is not None and drafter.graphs else {},
            "draft_catch_up_graph_replays": (dict(drafter.catch_up_graphs.hits)
                                             if drafter is not None and drafter.catch_up_graphs else {}),
            "verify_graph_replays": dict(verifier.hits) if verifier else {}})
        _free(llm)
    tmp.cleanup()
    return {"bench": "draft", "shape": args.model or args.shape, "device": device_name(torch.device(args.device)),
            "dtype": dtype, "k": k, "input_len": args.input_len, "steps": args.output_len,
            "plain": {"decode_step_ms": round(decode_ms, 4), "tok_s": round(1e3 / decode_ms, 1)},
            "fixed_draft_verify_step_ms": round(verify_ms, 4), "verify_vs_decode": round(verify_ms / decode_ms, 3),
            "results": rows}
