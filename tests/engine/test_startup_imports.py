"""Start-up stays light on CPU: loading a model and generating imports neither torch._dynamo nor Triton
(nn.Embedding's random init on ``meta`` used to pull both in: about a second at start-up, and
Triton's binding leak report on every exit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from modeserve.engine.models.random_checkpoint import write_random_checkpoint

PROBE = """
import sys
from modeserve.engine import LLM, SamplingParams
params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
out = LLM(model=sys.argv[1]).generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params)
print(len(out[0].token_ids), sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


def test_cpu_generate_imports_neither_dynamo_nor_triton(tmp_path: Path) -> None:
    folder = write_random_checkpoint(tmp_path, "tiny", seed=1)
    run = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-2] == "2 []", run.stdout
