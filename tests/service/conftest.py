from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama3", tmp_path_factory.mktemp("tiny-serve"))
