"""``modeserve generate "prompt"``: stream text from a model (the embedded default when none given)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from .engine_args import add_engine_args, engine_kwargs


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("generate", help="generate text for one prompt, streamed")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template (default on)")
    add_engine_args(p)
    p.set_defaults(func=run)


def load_progress(desc: str) -> tuple[Callable[[str], None], Callable[[], None]]:
    """A progress bar over weight tensors (to stderr); returns (update, close)."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit=" tensors", file=sys.stderr, leave=False)
    return (lambda _name: bar.update(1)), bar.close


def run(args: argparse.Namespace) -> int:
    from ...engine import LLM, SamplingParams
    from ...engine.tokenizer import IncrementalDetokenizer

    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed)  # bad values: said before loading
    update, close = load_progress("loading weights")
    try:
        llm = LLM(model=args.model, progress=update, **engine_kwargs(args))
    finally:
        close()
    req = llm.make_request(llm.encode(args.prompt, chat=args.chat), sp)
    llm.add_request(req)
    assert llm.tokenizer is not None
    detok = IncrementalDetokenizer(llm.tokenizer)
    while not req.finished:
        for ev in llm.step():
            sys.stdout.write(detok.push(ev.new_token_ids))
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0
