"""``modeserve serve`` with its engine in a child process (the default) as a real process: greedy
tokens equal ``LLM.generate``'s; the engine does not outlive serve, even a serve killed with SIGKILL;
an engine that dies makes serve exit non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from modeserve.engine import LLM, SamplingParams
from modeserve.service.rpc.client import GenerateClient

ENGINE_FLAGS = ["--page-size", "4", "--kv-cache-tokens", "2048", "--chunked-prefill-size", "16", "--enable-mixed"]


def start(model: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", "serve", "--model", str(model),
                             "--host", "127.0.0.1", "--port", "0", "--no-http", "--grace-period", "5", *ENGINE_FLAGS, *flags],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "modeserve serve listening on" in line, (line, proc.poll())
    return proc, f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        stat = _stat(int(p.name)) if p.name.isdigit() else None
        if stat is not None and int(stat[1]) == pid:
            out.append(int(p.name))
    return out


def engine_of(proc: subprocess.Popen[str]) -> int:
    (pid,) = children(proc.pid)
    return pid


def wait_gone(pid: int, timeout: float) -> bool:
    """The process has exited (a zombie no one reaps counts as exited) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = _stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_greedy_tokens_equal_llm_generate_then_sigterm_stops_both(tiny_model: Path) -> None:
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40)), [11] * 20]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(tiny_model), page_size=4).generate(prompt_token_ids=prompts,
                                                                                       sampling_params=sp)]
    proc, address = start(tiny_model)
    engine = engine_of(proc)
    client = GenerateClient(address)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: client.generate(token_ids=p, max_new_tokens=24, ignore_eos=True), prompts))
        assert [c.token_ids for c in got] == expected
        assert all(c.finish_reason == "length" for c in got)
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert wait_gone(engine, 10)


def test_sigkill_of_serve_leaves_no_engine(tiny_model: Path) -> None:
    proc, _ = start(tiny_model)
    engine = engine_of(proc)
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone(engine, 15), "the engine outlived serve"


def test_engine_that_dies_makes_serve_exit_non_zero(tiny_model: Path) -> None:
    proc, _ = start(tiny_model)
    engine = engine_of(proc)
    os.kill(engine, signal.SIGKILL)
    assert proc.wait(timeout=30) == 1


def test_no_engine_process_serves_in_one_process(tiny_model: Path) -> None:
    proc, address = start(tiny_model, "--no-engine-process")
    try:
        assert children(proc.pid) == []
        client = GenerateClient(address)
        assert len(client.generate(token_ids=[5, 6, 7], max_new_tokens=4, ignore_eos=True).token_ids) == 4
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
