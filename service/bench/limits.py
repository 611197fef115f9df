"""Physical limits measured in the same run as a benchmark: device-copy bandwidth and bf16 matmul
rate, and the roofline cost model of a decoder step built on them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...engine.models.model_config import ModelConfig

if TYPE_CHECKING:
    from ...engine.runner.model_runner import ModelRunner


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ratio(x: float) -> float:
    """A figure over its limit, to three significant digits (a tiny CPU model's are far below 0.001)."""
    return float(f"{x:.3g}")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy (read + write both counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * n / (time.perf_counter() - start)


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of a large matmul: bf16 on CUDA, float32 (and smaller) on CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else min(n, 1024)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


@dataclass(frozen=True)
class Roofline:
    """Lower bounds for a decoder with ``num_params`` weights of ``itemsize`` bytes on a device of
    ``bandwidth`` B/s and ``flops`` FLOP/s (both measured)."""

    mc: ModelConfig
    num_params: int
    itemsize: int
    kv_bytes_per_token: int
    bandwidth: float
    flops: float

    @property
    def matmul_params(self) -> int:
        """Weights a token is multiplied with: an untied embedding table is only looked up."""
        untied_embedding = 0 if self.mc.tie_word_embeddings else self.mc.vocab_size * self.mc.hidden_size
        return self.num_params - untied_embedding

    def prefill_flops(self, prompt_lens: list[int]) -> float:
        """Matmul FLOPs of prefilling these prompts: the layers' weights for every token, causal
        attention (q·k and p·v), the LM head for the last token of each prompt."""
        mc = self.mc
        head = mc.vocab_size * mc.hidden_size
        dense = 2 * (self.matmul_params - head) * sum(prompt_lens)
        attn = sum(2 * 2 * mc.num_layers * mc.num_heads * mc.head_dim * n * (n + 1) / 2 for n in prompt_lens)
        return dense + attn + 2 * head * len(prompt_lens)

    def decode_step_bytes(self, context_lens: list[int]) -> float:
        """Bytes one decode step must read: each multiplied weight once, each context token's K and V."""
        return self.matmul_params * self.itemsize + self.kv_bytes_per_token * sum(context_lens)

    def decode_step_seconds(self, context_lens: list[int]) -> float:
        """The whole step as one kernel could run it: all bytes at the bandwidth or all matmul FLOPs
        at the matmul rate, whichever takes longer."""
        flops = 2 * self.matmul_params * len(context_lens)
        return max(self.decode_step_bytes(context_lens) / self.bandwidth, flops / self.flops)

    def decode_step_seconds_by_op(self, context_lens: list[int]) -> float:
        """The step as separate operations, each at its own limit: the weight matmuls (bytes or FLOPs,
        whichever binds: FLOPs from batch ~200 on an H200) then attention reading the KV. Above the
        bound of ``decode_step_seconds`` once the matmuls are compute-bound."""
        flops = 2 * self.matmul_params * len(context_lens)
        weights = max(self.matmul_params * self.itemsize / self.bandwidth, flops / self.flops)
        return weights + self.kv_bytes_per_token * sum(context_lens) / self.bandwidth


def measure_roofline(runner: ModelRunner) -> Roofline:
    """The runner's model (its parameters, dtype, KV bytes per token) on its device, limits measured now."""
    device = runner.device
    num_params = sum(p.numel() for p in runner.model.parameters())
    nbytes = 2**30 if device.type == "cuda" else 2**26
    return Roofline(runner.model_config, num_params, runner.dtype.itemsize, runner.kv_cache.bytes_per_token,
                    copy_bandwidth(device, nbytes), matmul_rate(device))
