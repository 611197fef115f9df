"""What the HTTP API tests share: a tiny random model that has a real tokenizer (SmolLM2's, so chat
templates and text work), ``modeserve`` processes serving HTTP, the greedy reference."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import json
import urllib.error
import urllib.request
from typing import Any

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.default_model import default_model_path
from modeserve.engine.tokenizer import load_tokenizer
from modeserve.service.rpc.engine_process import read_addresses, stop_process
from tests.engine.tiny_models import make_tiny_model

ENGINE_FLAGS = ["--page-size", "4", "--kv-cache-tokens", "8192", "--chunked-prefill-size", "32", "--enable-mixed"]
CHAT = [{"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Which planet is the largest?"}]


def tiny_model_with_tokenizer(folder: Path) -> Path:
    tokenizer = load_tokenizer(default_model_path())
    assert tokenizer is not None
    make_tiny_model("llama3", folder, vocab_size=tokenizer.vocab_size)
    tokenizer.hf_tokenizer.save_pretrained(folder)
    return folder


def call(base: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    """A plain HTTP request (POST when it has a body): the status and the JSON it answered."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_http(base: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if call(base, "/health")[0] == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{base}/health never answered 200")


@contextlib.contextmanager
def http_process(*args: str) -> Iterator[tuple[str, str]]:
    """``modeserve <args> --http-port 0``: yields (gRPC address, HTTP base URL), as the child announces them."""
    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", *args, "--host", "127.0.0.1", "--port",
                             "0", "--http-port", "0", "--grace-period", "5"], stdout=subprocess.PIPE, text=True)
    try:
        addresses = read_addresses(proc, args[0], 300, "http")
        address, base = addresses["grpc"], f"http://{addresses['http']}"
        wait_http(base)
        yield address, base
    finally:
        assert stop_process(proc) == 0


def greedy_reference(model: Path, prompts: list[list[int]], max_new: int, **sampling: object) -> list[tuple[list[int], str, str]]:
    """(token ids, text, finish reason) of ``LLM.generate``, greedy."""
    llm = LLM(model=str(model), page_size=16)
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new, **sampling)  # type: ignore[arg-type]
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
