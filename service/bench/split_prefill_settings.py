"""``bench split-prefill``'s flags and the scheduling settings they make: no chunking, chunked prefill,
MIXED, SPLIT_PREFILL taking turns with the decodes, and (CUDA) its slices beside them."""

from __future__ import annotations

import argparse
from typing import Any, Literal, NamedTuple

from ...engine.config import SchedulerConfig
from .batch import add_runner_flags


Mode = Literal["no_chunking", "chunked", "mixed", "split_prefill"]


class Setting(NamedTuple):
    label: str  # e.g. "split-65536"
    mode: Mode
    params: dict[str, Any]  # the LLM keywords that make it


def device_defaults(device: str) -> dict[str, list[int]]:
    """The H200 sizes of the issue, or sizes scaled for CPU (prompts that take a second or two there)."""
    if device.startswith("cuda"):
        return {"prompt_lens": [16384, 32768], "chunk_sizes": [2048, 4096, 8192],
                "split_budgets": [16384, 65536, 131072]}
    return {"prompt_lens": [1024, 2048], "chunk_sizes": [128, 256, 512], "split_budgets": [1024, 4096, 8192]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runner_flags(p, shape=None, device="cpu")
    cuda, cpu = device_defaults("cuda"), device_defaults("cpu")
    for flag, key, what in (("--prompt-lens", "prompt_lens", "long prompts, one arrival each"),
                            ("--chunk-sizes", "chunk_sizes", "chunked_prefill_size of the chunked settings"),
                            ("--split-budgets", "split_budgets", "split_prefill_token_budget (tokens x layers a "
                                                                 "step) of the SPLIT_PREFILL settings")):
        p.add_argument(flag, type=int, nargs="+" if key == "prompt_lens" else "*", default=None,
                       help=f"{what} (default: {' '.join(map(str, cuda[key]))} on CUDA, "
                            f"{' '.join(map(str, cpu[key]))} on CPU; none given: none of those settings)")
    p.add_argument("--split-min-tokens", type=int, default=None,
                   help="split_prefill_min_tokens (default: the config's, or the shortest prompt if that is shorter)")
    p.add_argument("--mixed-prefill-ratios", type=float, nargs="*", default=[SchedulerConfig.max_prefill_ratio, 0.9],
                   help="max_prefill_ratio of the MIXED settings")
    p.add_argument("--overlap-decode-steps", type=int, nargs="+", default=[1, 3],
                   help="CUDA: split_prefill_decode_steps of the settings whose slices run beside the decodes")
    p.add_argument("--overlap-sms", type=int, nargs="+", default=[0],
                   help="CUDA: split_prefill_overlap_sms of those settings (0: the slices on every SM)")
    p.add_argument("--overlap-gemms", choices=("cublas", "triton"), nargs="+", default=["cublas"],
                   help="CUDA: small_batch_gemm of those settings (the decode steps' linear layers; "
                        "triton: no thread-block clusters)")
    p.add_argument("--overlap-confine", choices=("off", "on"), nargs="+", default=["off"],
                   help="CUDA: split_prefill_confine_decodes of the settings with --overlap-sms > 0 (on: the "
                        "decodes on the SMs the slices leave only while a slice runs)")
    p.add_argument("--num-decoders", type=int, default=32)
    p.add_argument("--decoder-prompt-len", type=int, default=128)
    p.add_argument("--warmup-steps", type=int, default=4, help="decode steps before the first steady stretch")
    p.add_argument("--steady-steps", type=int, default=16, help="decode steps of steady ITL before each arrival")
    p.add_argument("--solo-repeats", type=int, default=3, help="solo prefills of each prompt (median)")
    p.add_argument("--warm-windows", type=int, default=1,
                   help="windows of the shortest prompt each setting runs, unmeasured, before its measured ones: the "
                        "first use of its steps' kernels (JIT modules, specialisations) stays out of the figures")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool (default: what a setting needs)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 on a busy machine: idle threads spin otherwise)")
    p.add_argument("--trace-dir", default=None,
                   help="also trace each window with torch.profiler (host ops; CUDA kernels on every stream): a "
                        "gzipped Chrome trace per (setting, prompt length) there, named in its row ('trace')")
    p.add_argument("--goal-itl-p99", type=float, default=1.5, help="goal: p99 ITL / steady ITL at most this")
    p.add_argument("--goal-ttft", type=float, default=1.25, help="goal: TTFT / solo prefill at most this")


def settings(args: argparse.Namespace, chunk_sizes: list[int], split_budgets: list[int],
             split_min_tokens: int) -> list[Setting]:
    """No chunking first: its engine measures the solo prefills."""
    out = [Setting("no-chunking", "no_chunking", {"chunked_prefill_size": None})]
    out += [Setting(f"chunked-{c}", "chunked", {"chunked_prefill_size": c}) for c in chunk_sizes]
    # MIXED's chunk starts every decoder in one step too (the ratio caps a long prompt's share far below it)
    chunk = max(SchedulerConfig.chunked_prefill_size or 0, args.num_decoders * args.decoder_prompt_len)
    out += [Setting(f"mixed-{r:g}", "mixed", {"chunked_prefill_size": chunk, "enable_mixed": True,
                                              "max_prefill_ratio": r}) for r in args.mixed_prefill_ratios]
    out += [Setting(f"split-{b}", "split_prefill", {"chunked_prefill_size": None, "enable_split_prefill": True,
                                                   "split_prefill_token_budget": b,
                                                   "split_prefill_min_tokens": split_min_tokens})
            for b in split_budgets]
    if args.device.startswith("cuda"):  # the slices on a stream of their own, beside the decode steps
        out += [Setting(f"split-{b}-overlap" + (f"-d{d}" if d > 1 else "") + (f"-sm{n}" if n else "")
                        + ("-conf" if c == "on" else "") + ("-tgemm" if g == "triton" else ""), "split_prefill",
                        {**o.params, "enable_split_prefill_overlap": True, "split_prefill_decode_steps": d,
                         "split_prefill_overlap_sms": n, **({"split_prefill_confine_decodes": True} if c == "on" else {}),
                         **({"small_batch_gemm": g} if g != "cublas" else {})})
                for b, o in zip(split_budgets, out[-len(split_budgets):]) for d in args.overlap_decode_steps
                for n in args.overlap_sms for c in args.overlap_confine if n or c == "off" for g in args.overlap_gemms]
    return out
