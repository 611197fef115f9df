"""The router's one edge check: a ``GenerateRequest`` → a validated ``Req`` (errors name the field)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ...engine.request import Req
from ...engine.request_limits import RequestLimits, check_prompt
from ...engine.sampling_params import SamplingParams
from ...engine.tokenizer import Tokenizer
from ...proto.v1 import generate_pb2

DEFAULT_MAX_NEW_TOKENS = 128


class InvalidField(ValueError):
    """A bad request field: ``param`` as the caller's API names it (the message starts with it)."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"{param}: {problem}" if not problem.startswith("must") else f"{param} {problem}")
        self.param = param


@dataclass(frozen=True)
class FieldNames:
    """What an API calls the fields ``RequestParser.make_req`` checks."""

    prompt: str
    max_new_tokens: str = "sampling.max_new_tokens"
    stop_token_ids: str = "sampling.stop_token_ids"


def sampling_from_proto(p: generate_pb2.SamplingParams) -> SamplingParams:
    """proto3 zeros mean 'default' where zero is not a valid value (see generate.proto)."""
    if p.max_new_tokens < 0:
        raise ValueError(f"sampling.max_new_tokens must be >= 1, got {p.max_new_tokens}")
    if p.top_k < -1:
        raise ValueError(f"sampling.top_k must be >= -1, got {p.top_k}")
    if p.top_p < 0 or p.top_p > 1:
        raise ValueError(f"sampling.top_p must be in (0, 1], got {p.top_p}")
    if p.logprobs < 0:
        raise ValueError(f"sampling.logprobs must be >= 0, got {p.logprobs}")
    try:
        return SamplingParams(
            max_new_tokens=p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
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


class RequestParser:
    """Validates requests against the served model's limits and draws the seeds of unseeded ones
    (here, not on a rank: a request's seed does not depend on where it runs)."""

    def __init__(self, tokenizer: Tokenizer | None, limits: RequestLimits, random_seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._rng = random.Random(random_seed)

    def parse(self, rid: str, request: generate_pb2.GenerateRequest) -> Req:
        """``ValueError`` naming the field."""
        sampling = sampling_from_proto(request.sampling)
        field = "token_ids" if request.token_ids else "text"
        return self.make_req(rid, self.prompt_ids(request), sampling, FieldNames(prompt=field))

    def make_req(self, rid: str, prompt_ids: list[int], sampling: SamplingParams, names: FieldNames) -> Req:
        """The request, checked against the model's limits (``InvalidField`` naming what is wrong as
        the caller's API names it), with its seed drawn if it has none."""
        if self.limits.max_new_tokens is not None and sampling.max_new_tokens > self.limits.max_new_tokens:
            raise InvalidField(names.max_new_tokens, f"must be <= {self.limits.max_new_tokens}, "
                                                     f"got {sampling.max_new_tokens}")
        bad_stop = [t for t in sampling.stop_token_ids if not 0 <= t < self.limits.vocab_size]
        if bad_stop:
            raise InvalidField(names.stop_token_ids, f"{bad_stop[0]} is outside the vocabulary")
        try:
            check_prompt(prompt_ids, sampling.max_new_tokens, self.limits)
        except ValueError as exc:
            raise InvalidField(names.prompt, str(exc)) from exc
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        return Req(rid=rid, prompt_ids=prompt_ids, sampling=sampling, seed=seed)

    def prompt_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        if request.text and request.token_ids:
            raise ValueError("give exactly one of text and token_ids, not both")
        if not request.text and not request.token_ids:
            raise ValueError("text / token_ids: the prompt is empty")
        if request.token_ids:
            return list(request.token_ids)
        self.check_text(request.text)
        if self.tokenizer is None:
            raise ValueError("text: this model has no tokenizer; send token_ids")
        if request.chat:
            return self.tokenizer.apply_chat_template(request.text)
        return self.tokenizer.encode(request.text)

    def check_text(self, text: str) -> None:
        if len(text) > self.limits.max_prompt_chars:
            raise ValueError(f"text: {len(text)} characters is over the limit of {self.limits.max_prompt_chars}")
