"""``curl`` (a subprocess, as a user types it) against ``modeserve serve`` on the embedded default
model: the chat completion of a plain question says "Paris", whole and streamed as SSE."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Iterator

import pytest

from modeserve.service.router.app import HttpAddress
from modeserve.service.router.in_process import start_serve

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")]
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32,
            "temperature": 0}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    app = start_serve("127.0.0.1:0", None, http=HttpAddress("127.0.0.1", 0))
    assert app.http is not None
    yield f"http://127.0.0.1:{app.http.port}"
    app.stop(grace=1)


def curl(*args: str) -> str:
    done = subprocess.run(["curl", "-sS", "--fail-with-body", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_curl_chat_completion_says_paris(base: str) -> None:
    out = json.loads(curl(f"{base}/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps(QUESTION)))
    assert "Paris" in out["choices"][0]["message"]["content"]
    assert out["choices"][0]["finish_reason"] == "stop" and out["object"] == "chat.completion"


def test_curl_streamed_chat_completion_says_paris(base: str) -> None:
    out = curl("-N", f"{base}/v1/chat/completions", "-H", "Content-Type: application/json",
               "-d", json.dumps({**QUESTION, "stream": True}))
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "Paris" in "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_curl_models_and_health(base: str) -> None:
    assert json.loads(curl(f"{base}/v1/models"))["data"][0]["id"]
    assert json.loads(curl(f"{base}/health")) == {"status": "ok"}
    bad = subprocess.run(["curl", "-s", "-w", "%{http_code}", f"{base}/v1/chat/completions", "-d", "{oops"],
                         capture_output=True, text=True, timeout=60)
    assert bad.stdout.endswith("400") and json.loads(bad.stdout[:-3])["error"]["type"] == "invalid_request_error"
