"""Shared test setup: GPU tests are skipped where no CUDA device is present."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Child interpreters the tests start keep the checkout off sys.path too (its kernels/ folder would
# shadow the `kernels` distribution transformers imports); pytest itself runs with -P and importlib mode.
os.environ.setdefault("PYTHONSAFEPATH", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


# Without a GPU, Triton kernels run in Triton's CPU interpreter (set before triton is imported), so
# CI checks the project's own kernels against the torch references too.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def triton_interpreter_scalar_index() -> Iterator[None]:
    """Triton 3.6's interpreter turns a loop bound read from memory into an int with
    ``int(ndarray of shape (1,))``, an error since numpy 2.4 (triton-lang/triton#9171, fixed upstream
    by taking ``.item()``): apply that fix while tests run under the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        yield
        return
    import numpy as np
    from triton.runtime import interpreter

    if np.lib.NumpyVersion(np.__version__) < "2.4.0" or not hasattr(interpreter, "_patch_lang_tensor"):
        yield
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: type, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
