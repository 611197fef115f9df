"""Text <-> token ids for a model: a thin wrapper over a Hugging Face fast tokenizer.

Invariants:
* ``decode`` never cleans up tokenization spaces, so decoding is a pure function of the ids and
  :class:`IncrementalDetokenizer` deltas concatenate to exactly ``decode(all_ids)``.
* Converting a GGUF vocabulary takes seconds; the converted files are cached under
  ``$XDG_CACHE_HOME/modeserve/tokenizers`` (else ``~/.cache/...``), keyed by the GGUF's resolved
  path, size, mtime and the transformers version. Cache entries appear atomically (written to a
  temporary folder, then renamed); an unwritable cache is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import transformers
from transformers import AutoTokenizer

from .models.model_path import checked_model_path

_log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Special tokens that end an assistant turn in well-known chat templates.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


class Tokenizer:
    """Encode/decode and chat formatting for one model.

    ``eos_token_ids`` holds every id that ends generation: the tokenizer's own EOS, any
    ``extra_eos_token_ids`` (e.g. from ``generation_config.json``), and each well-known
    end-of-turn special token that the chat template itself emits (so a chat reply stops at
    ``<|im_end|>`` even when the tokenizer's EOS is ``<|endoftext|>``). Order: EOS first, no repeats.
    """

    def __init__(self, hf_tokenizer: Any, name: str, extra_eos_token_ids: Sequence[int] = ()) -> None:
        self._hf = hf_tokenizer
        self._name = name
        ids: list[int] = [] if hf_tokenizer.eos_token_id is None else [int(hf_tokenizer.eos_token_id)]
        ids.extend(int(i) for i in extra_eos_token_ids)
        template = hf_tokenizer.chat_template
        template_text = json.dumps(template) if isinstance(template, dict) else (template or "")
        added = hf_tokenizer.get_added_vocab()
        ids.extend(added[t] for t in _END_OF_TURN_TOKENS if t in added and t in template_text)
        self._eos_ids = tuple(dict.fromkeys(ids))

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped Hugging Face tokenizer."""
        return self._hf

    @property
    def name(self) -> str:
        return self._name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        bos = self._hf.bos_token_id
        return None if bos is None else int(bos)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce: base vocabulary plus added tokens."""
        return len(self._hf)

    def encode(self, text: str) -> list[int]:
        """Token ids for a plain prompt, with exactly the special tokens that ``tokenizer(text)`` adds."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return list(self._hf(text)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        limit = self.vocab_size
        bad = [i for i in ids if not 0 <= i < limit]
        if bad:
            raise ValueError(f"token ids out of range [0, {limit}): {bad[:5]}")
        text: str = self._hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return text

    def apply_chat_template(self, messages: list[dict[str, str]] | str) -> list[int]:
        """Token ids of the rendered conversation followed by the assistant-turn prompt.

        A str is one user message. The template supplies every special token, so none are added.
        """
        if self._hf.chat_template is None:
            raise ValueError(f"tokenizer {self._name!r} has no chat template")
        conversation = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts or a str")
        for m in conversation:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs str 'role' and 'content', got {m!r}")
        text = self._hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return list(self._hf(text, add_special_tokens=False)["input_ids"])


def _cache_root() -> Path | None:
    base = os.environ.get("XDG_CACHE_HOME")
    try:  # the XDG spec says a relative XDG_CACHE_HOME is to be ignored
        root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    except RuntimeError:  # no home directory can be determined
        return None
    return root / "modeserve" / "tokenizers"


def _cache_key(gguf: Path) -> str:
    st = gguf.stat()
    ident = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _convert_gguf_tokenizer(gguf: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _store(root: Path, entry: Path, hf_tokenizer: Any) -> None:
    """Write the converted tokenizer to ``entry`` atomically; a failure only logs."""
    tmp: str | None = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        hf_tokenizer.save_pretrained(tmp)
        os.rename(tmp, entry)  # fails if another process won the race: theirs is as good
        tmp = None
    except OSError as exc:
        _log.info("not caching tokenizer in %s: %s", root, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf_tokenizer(gguf: Path) -> Any:
    root = _cache_root()
    entry = None if root is None else root / _cache_key(gguf)
    if entry is not None and entry.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except (OSError, ValueError) as exc:
            _log.warning("replacing unreadable tokenizer cache %s: %s", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    hf_tokenizer = _convert_gguf_tokenizer(gguf)
    if root is not None and entry is not None and not entry.exists():
        _store(root, entry, hf_tokenizer)
    return hf_tokenizer


def _generation_eos_ids(folder: Path) -> list[int]:
    """EOS ids listed in a model folder's generation_config.json (int or list), if any."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value] if isinstance(value, list) else []


def load_tokenizer(model_path: str | Path) -> Tokenizer | None:
    """The tokenizer of a ``.gguf`` file or a Hugging Face folder; None for a folder without one.

    Raises ValueError for a missing path or a file that is not ``.gguf``.
    """
    p = checked_model_path(model_path)
    if p.is_file():
        return Tokenizer(_load_gguf_tokenizer(p), name=p.stem)
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        return None
    return Tokenizer(AutoTokenizer.from_pretrained(str(p)), name=p.name, extra_eos_token_ids=_generation_eos_ids(p))


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Invariants: ``"".join(all deltas) + flush() == tokenizer.decode(all ids)``; a delta never ends
    in U+FFFD (an incomplete UTF-8 character is held back until later tokens complete it); each
    push decodes only the ids since the last emitted boundary plus the chunk before it, so its cost
    does not grow with the length of the stream. ``_prefix`` and ``_read`` always sit on character
    boundaries of the full text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window (already-emitted ids)
        self._read = 0  # ids before this are emitted
        self._flushed = False

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _pending(self) -> tuple[str, str]:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        return prefix_text, full_text

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the newly completed text (maybe empty)."""
        if self._flushed:
            raise ValueError("push after flush: the detokenizer is finished")
        self._ids.extend(int(i) for i in ids)
        prefix_text, full_text = self._pending()
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """End of stream: return whatever is still held back, incomplete characters included."""
        if self._flushed:
            return ""
        self._flushed = True
        prefix_text, full_text = self._pending()
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]
