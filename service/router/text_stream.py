"""Text deltas for a streamed request: UTF-8-safe (incremental detokenizer) and stop-string-safe
(text that may be the start of a stop string is held back until it is known not to be one)."""

from __future__ import annotations

from typing import Sequence

from ...engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._sent = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._text += self._detok.push(token_ids)
        upto = max(self._sent, min(len(self._text) - self._hold, self._first_stop()))
        delta, self._sent = self._text[self._sent : upto], upto
        return delta

    def finish(self) -> str:
        """The rest of the text, cut before the first stop string (stop strings are not returned)."""
        self._text += self._detok.flush()
        delta = self._text[self._sent : max(self._first_stop(), self._sent)]
        self._sent = len(self._text)
        return delta

    def _first_stop(self) -> int:
        """Index of the earliest complete stop string in the text (its length when there is none)."""
        found = [i for s in self._stop if (i := self._text.find(s, self._sent)) != -1]  # none starts earlier
        return min(found, default=len(self._text))
