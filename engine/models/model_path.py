"""The path a model is read from: a ``.gguf`` file or a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path


def checked_model_path(path: str | Path, not_gguf_hint: str = "") -> Path:
    """``path`` with ``~`` expanded. ValueError for a path that does not exist, or for a file that is
    not ``.gguf`` (``not_gguf_hint`` ends that message)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"model path {str(p)!r} does not exist")
    if p.is_file() and p.suffix != ".gguf":
        raise ValueError(f"model file {str(p)!r} is not a .gguf file{not_gguf_hint}")
    return p
