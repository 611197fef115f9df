"""Speculative decoding with n-gram drafts on CPU, beside plain decoding in the same run: input-grounded
prompts (repeat a passage, edit a code snippet: the answer copies the prompt, so prompt lookup finds
drafts) on the default model, greedy, at each batch size. Per batch size: output tok/s with and
without drafts and their ratio, the acceptance length (tokens a verify step emits per request: kept
drafts + 1) and the outputs' agreement (greedy is exact, so they must be equal)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ...engine import LLM, SamplingParams

PASSAGE = ("The river rises in the northern hills, runs south through three market towns and a long valley "
           "of orchards, and reaches the sea at a wide estuary where the old harbour still stands.")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n"
        "    return result\n")
TASKS = (f"Repeat the following passage word for word.\n\n{PASSAGE}",
         f"Rename the variable result to subtotal in this code and show the whole function.\n\n{CODE}",
         f"Copy this text exactly, then stop.\n\n{PASSAGE}",
         f"Rewrite this function with the loop variable called entry, changing nothing else.\n\n{CODE}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="speculative_num_steps")
    p.add_argument("--threads", type=int, default=1)


def _timed(llm: LLM, prompts: list[str], sp: SamplingParams) -> tuple[float, list[list[int]]]:
    llm.generate(prompts=prompts[:1], sampling_params=sp.replace(max_new_tokens=2), chat=True)  # warm
    start = time.perf_counter()
    outs = llm.generate(prompts=prompts, sampling_params=sp, chat=True)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    results = []
    for bs in args.batch_sizes:
        prompts = [TASKS[i % len(TASKS)] for i in range(bs)]
        plain_s, plain = _timed(LLM(model=args.model), prompts, sp)
        llm = LLM(model=args.model, speculative_algorithm="ngram", speculative_num_steps=args.k)
        spec_s, spec = _timed(llm, prompts, sp)
        st = llm.stats()["speculative"]
        verifies = llm.stats()["requests_by_mode"].get("TARGET_VERIFY", 0)  # request-steps of verify
        tokens = sum(map(len, spec))
        results.append({
            "batch_size": bs, "output_tokens": tokens,
            "plain_tok_s": round(sum(map(len, plain)) / plain_s, 1), "ngram_tok_s": round(tokens / spec_s, 1),
            "ngram_vs_plain_tok_s": round(tokens / spec_s / (sum(map(len, plain)) / plain_s), 3),
            "acceptance_length": round((st["accepted_tokens"] + verifies) / max(verifies, 1), 3),
            "draft_tokens": st["draft_tokens"], "accepted_tokens": st["accepted_tokens"],
            "outputs_equal": spec == plain})
    return {"bench": "speculative", "algorithm": "ngram", "device": "cpu", "k": args.k, "threads": args.threads,
            "new_tokens": args.new_tokens, "results": results}
