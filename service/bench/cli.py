"""``modeserve bench ...``: benchmarks that print JSON (figure, peer or limit, ratio): one object, or one a
line as they are measured."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any, Callable, Iterable

from . import dllm, serving, speculative, split_prefill_settings, streams
from .batch import add_runner_flags
from ..cli.engine_args import add_engine_args


def add_parser(sub: Any) -> None:
    from . import faults, fuzz

    bench = sub.add_parser("bench", help="benchmarks (JSON out)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    # (sub-command, help, its flags, the module that runs it), in ``bench --help``'s order
    benches: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None], str], ...] = (
        ("offline", "LLM.generate on a prompt set vs transformers on the same prompts", _offline_args, "offline"),
        ("serving", "load generator over serve and router+engine: tok/s, TTFT, ITL vs offline",
         serving.add_arguments, "serving"),
        ("streams", "N concurrent streams against serve, every status code counted", streams.add_arguments,
         "streams"),
        ("speculative", "n-gram speculative decoding vs plain, input-grounded prompts (CPU)",
         speculative.add_arguments, "speculative"),
        ("tracing", "decode step with tracing on (100% sampled, OTLP) vs off", _tracing_args, "tracing"),
        ("dp", "output tokens/s through one router over 1, 2, 4 CPU engine processes", _dp_args, "dp"),
        ("faults", "engine kill storm, KV exhaustion, router restart, slow-loris clients (CPU)",
         faults.add_arguments, "faults"),
        ("fuzz", "hypothesis cases against engine + router processes: every one OK or refused", fuzz.add_arguments,
         "fuzz"),
        ("latency", "one batch on random weights of a named shape vs the roofline (GPU)", _latency_args, "latency"),
        ("verify", "a TARGET_VERIFY step of k drafts vs a DECODE step, k and batch size (GPU)", _verify_args,
         "verify_cost"),
        ("draft", "batch-1 speculative decoding with a draft model, end to end, vs plain (GPU)", _draft_args,
         "draft_cost"),
        ("throughput", "many requests at once on random weights vs the roofline (GPU)", _throughput_args,
         "throughput"),
        ("attention", "decode attention per layer, each backend vs the KV-bytes roofline (GPU)", _attention_args,
         "attention"),
        ("sampling", "the sampling step: torch reference vs the fused kernel, vs its bytes (GPU)", _sampling_args,
         "sampling"),
        ("split-prefill", "decoders' ITL and a long prompt's TTFT: no chunking, chunked, MIXED, SPLIT_PREFILL",
         split_prefill_settings.add_arguments, "split_prefill"),
        ("dllm", "a DLLM_EXTEND step (block diffusion) vs a DECODE step, block and batch size; tok/s by tokens "
         "committed a step", dllm.add_arguments, "dllm"),
    )
    for name, help_text, add_arguments, module in benches:
        p = kinds.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(func=_json_bench(module))


def _offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--min-prompt-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--length-dist", choices=["loguniform", "uniform"], default="loguniform",
                   help="prompt lengths: log-uniform (chat-like: many short, a long tail) or uniform")
    p.add_argument("--baseline", choices=["transformers", "none"], default="transformers")
    p.add_argument("--baseline-batch-size", type=int, default=None,
                   help="transformers batch size (default: all prompts in one padded batch)")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)


def _tracing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder (default: a random model of --shape)")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=1000, help="decode steps of a long run")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds (medians reported)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpus", default=None, help="run on these CPUs only (e.g. 1): steadier figures on a shared machine")
    p.add_argument("--exporter", choices=("otlp", "none"), default="otlp",
                   help="none: spans are made but handed to an exporter that drops them (what export costs)")


def _dp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder (default: a random model of --shape)")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--engines", default="1,2,4", help="engine process counts to compare")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)


def _latency_args(p: argparse.ArgumentParser) -> None:
    _gpu_bench_args(p, input_len=512, output_len=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--baseline-output-len", type=int, default=64,
                   help="tokens generated by the transformers baseline (its decode step is their mean)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="also profile this many decode steps (device time per kernel, JSON 'decode_profile') "
                        "and one prefill (device time per kernel and host time per op, 'prefill_profile')")


def _verify_args(p: argparse.ArgumentParser) -> None:
    _gpu_bench_args(p, input_len=512, output_len=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)), help="drafts per verify step")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="also profile this many decode and verify steps at the smallest batch size and the "
                        "largest k (device time per kernel), and time each linear layer at the verify's rows")


def _draft_args(p: argparse.ArgumentParser) -> None:
    _gpu_bench_args(p, input_len=512, output_len=128)
    p.add_argument("--k", type=int, default=4, help="speculative_num_steps")
    p.add_argument("--drafts", nargs="+", default=["self", "llama-3.2-1b"],
                   help="draft models: 'self' (the target's own weights) or shape presets")


def _throughput_args(p: argparse.ArgumentParser) -> None:
    _gpu_bench_args(p, input_len=1024, output_len=512)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--enable-mixed", action="store_true", help="prefill chunks ride along with decodes")
    p.add_argument("--baseline-num-prompts", type=int, default=64, help="prompts run through the baseline")
    p.add_argument("--baseline-batch-size", type=int, default=64)


def _attention_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", nargs="+", default=["flashinfer", "flashinfer-tensor-cores",
                                                      "flashinfer-cuda-cores", "triton"])
    p.add_argument("--layers", type=int, default=8, help="layers captured in the timed graph")
    _options(p, batch_sizes=[1, 8, 64, 256], context_len=1024, num_heads=32, num_kv_heads=8, head_dim=128,
             page_size=16, repeats=50, dtype="bfloat16")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top-k", type=int, default=0, help="<= 0: off")
    p.add_argument("--logit-scale", type=float, default=4.0, help="standard deviation of the random logits")
    _options(p, batch_sizes=[1, 64, 256], vocab=128256, temperature=0.8, top_p=0.95, min_p=0.0, repeats=20,
             device="cuda")


def _options(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """``--name`` options of the type of their default (a list default: one or more of its items')."""
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, list):
            p.add_argument(flag, nargs="+", type=type(default[0]), default=default)
        else:
            p.add_argument(flag, type=type(default), default=default)


def _gpu_bench_args(p: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    add_runner_flags(p)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="chunked prefill size")
    p.add_argument("--baseline", choices=["transformers", "none"], default="none")


def _json_bench(module: str) -> Callable[[argparse.Namespace], int]:
    """A sub-command that runs ``modeserve.service.bench.<module>.run`` (imported lazily) and prints its JSON:
    a dict on one line, or each object of an iterable on its own line as soon as it comes."""

    def run(args: argparse.Namespace) -> int:
        out: dict[str, Any] | Iterable[dict[str, Any]] = importlib.import_module(f".{module}", __package__).run(args)
        for line in [out] if isinstance(out, dict) else out:
            print(json.dumps(line), flush=True)
        return 0

    return run
