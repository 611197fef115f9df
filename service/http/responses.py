"""OpenAI's response bodies from the request path's ``Delta``s: chat completions and text
completions, whole or as stream chunks, with their ``logprobs`` and ``usage``."""

from __future__ import annotations

import time
from typing import Any, Sequence

from ...engine.tokenizer import Tokenizer
from ..router.generation import Delta, Usage

Json = dict[str, Any]


def usage_json(usages: Sequence[Usage]) -> Json:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)}}


class ResponseFormat:
    """One request's response envelope (``id``, ``created``, ``model``) and the token strings of its logprobs."""

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, chat: bool, token_ids: bool = False) -> None:
        self.id = rid
        self.token_ids = token_ids
        self.model = model
        self.created = int(time.time())
        self.chat = chat
        self._tokenizer = tokenizer

    def _envelope(self, obj: str, choices: list[Json]) -> Json:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def token(self, token_id: int) -> str:
        tok = self._tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"

    def _entry(self, token_id: int, logprob: float) -> Json:
        s = self.token(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    def logprobs(self, d: Delta, offset: int = 0) -> Json | None:
        """The delta's logprobs in the chat (``content``) or completions (``tokens`` ...) shape."""
        if not d.logprobs:
            return None
        tops = d.top_logprobs or [() for _ in d.logprobs]
        if self.chat:
            return {"content": [{**self._entry(t, lp), "top_logprobs": [self._entry(a, alp) for a, alp in alts]}
                                for t, lp, alts in zip(d.token_ids, d.logprobs, tops)]}
        tokens = [self.token(t) for t in d.token_ids]
        offsets = [offset + sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
        top = [{self.token(a): alp for a, alp in alts} for alts in tops] if d.top_logprobs else None
        return {"tokens": tokens, "token_logprobs": d.logprobs, "top_logprobs": top, "text_offset": offsets}

    def chunk(self, index: int, d: Delta | None, text: str = "", offset: int = 0, first: bool = False) -> Json:
        """A stream chunk: the delta's text (or ``text`` alone), its logprobs and finish reason."""
        finish = d.finish_reason if d is not None else None
        logprobs = self.logprobs(d, offset) if d is not None else None
        body = text or (d.text if d is not None else "")
        if self.chat:
            delta: Json = {"role": "assistant", "content": body} if first else {"content": body}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": body, "logprobs": logprobs, "finish_reason": finish}
        if self.token_ids:
            choice["token_ids"] = d.token_ids if d is not None else []
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usages: Sequence[Usage]) -> Json:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage_json(usages)
        return out

    def whole(self, choices: Sequence[tuple[str, list[int], Delta, Json | None]]) -> Json:
        """The non-streamed response: per choice its whole text and token ids, its last delta and its logprobs."""
        out = []
        for i, (text, ids, last, logprobs) in enumerate(choices):
            if self.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                          "finish_reason": last.finish_reason}
            else:
                choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            if self.token_ids:
                choice["token_ids"] = ids
            out.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", out)
        body["usage"] = usage_json([last.usage for *_, last, _ in choices if last.usage is not None])
        return body


def merge_logprobs(parts: Sequence[Json | None]) -> Json | None:
    """The logprobs of a whole choice from those of its deltas."""
    kept = [p for p in parts if p is not None]
    if not kept:
        return None
    if "content" in kept[0]:
        return {"content": [c for p in kept for c in p["content"]]}
    merged: Json = {k: [] for k in ("tokens", "token_logprobs", "text_offset")}
    for p in kept:
        for k in merged:
            merged[k] += p[k]
    merged["top_logprobs"] = None if kept[0]["top_logprobs"] is None else [t for p in kept for t in p["top_logprobs"]]
    return merged
