"""Validate a ``GenerateRequest`` and turn it into engine inputs; errors name the field."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.sampling_params import SamplingParams
from ...proto.v1 import generate_pb2

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class RequestLimits:
    max_context: int
    vocab_size: int
    max_new_tokens: int  # upper bound a client may ask for
    max_prompt_chars: int  # refuse larger text before tokenizing it


def sampling_from_proto(p: generate_pb2.SamplingParams, limits: RequestLimits) -> SamplingParams:
    """proto3 zeros mean 'default' where zero is not a valid value (see generate.proto)."""
    if p.max_new_tokens < 0:
        raise ValueError(f"sampling.max_new_tokens must be >= 1, got {p.max_new_tokens}")
    max_new = p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if max_new > limits.max_new_tokens:
        raise ValueError(f"sampling.max_new_tokens must be <= {limits.max_new_tokens}, got {max_new}")
    if p.top_k < -1:
        raise ValueError(f"sampling.top_k must be >= -1, got {p.top_k}")
    if p.top_p < 0 or p.top_p > 1:
        raise ValueError(f"sampling.top_p must be in (0, 1], got {p.top_p}")
    if p.logprobs < 0:
        raise ValueError(f"sampling.logprobs must be >= 0, got {p.logprobs}")
    bad_stop = [t for t in p.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad_stop:
        raise ValueError(f"sampling.stop_token_ids: {bad_stop[0]} is outside the vocabulary")
    try:
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=p.temperature,
            top_p=p.top_p or 1.0,
            top_k=p.top_k if p.top_k > 0 else -1,
            min_p=p.min_p,
            seed=p.seed if p.HasField("seed") else None,
            stop=tuple(p.stop),
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs if p.logprobs > 0 else None,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            repetition_penalty=p.repetition_penalty or 1.0,
        )
    except ValueError as exc:
        raise ValueError(f"sampling.{exc}") from exc


def check_prompt_shape(req: generate_pb2.GenerateRequest, limits: RequestLimits) -> None:
    if req.text and req.token_ids:
        raise ValueError("give exactly one of text and token_ids, not both")
    if not req.text and not req.token_ids:
        raise ValueError("text / token_ids: the prompt is empty")
    if len(req.text) > limits.max_prompt_chars:
        raise ValueError(f"text: {len(req.text)} characters is over the limit of {limits.max_prompt_chars}")
    if len(req.token_ids) >= limits.max_context:
        raise ValueError(f"token_ids: {len(req.token_ids)} tokens do not fit the context of {limits.max_context}")
    bad = [t for t in req.token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"token_ids: {bad[0]} is outside the vocabulary [0, {limits.vocab_size})")
