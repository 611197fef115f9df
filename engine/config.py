"""Engine configuration: one frozen tree, validated when built, passed down from the entry point."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(frozen=True)
class RunnerConfig:
    """What the model runner (device side) needs: weights, memory, kernels."""

    model: str | None = None  # HF folder, .gguf file, or None for the embedded default model
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    page_size: int = 16
    kv_cache_tokens: int | None = None  # KV slots; None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_running_requests: int = 256
    max_context_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"
    kernel_backend: str = "auto"  # elementwise ops: auto (triton on CUDA), torch, triton
    load_format: str = "auto"  # auto: the checkpoint's weights; dummy: random weights of its config.json
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256  # decode batches up to this size replay captured graphs
    # EXTEND/MIXED steps (and DLLM_EXTEND steps its own graphs do not take) of up to
    # piecewise_cuda_graph_max_tokens tokens replay the model in pieces captured between its attention
    # calls (CUDA only)
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int = 2048
    # speculative_algorithm "draft": the draft model (HF folder or .gguf) that runs beside the target
    speculative_draft_model: str | None = None
    # block-diffusion models (SDAR): the block and the mask token, where the checkpoint's config.json
    # has no block_size / mask_token_id (or to override them)
    dllm_block_size: int | None = None
    dllm_mask_token_id: int | None = None
    # ranks (a process and a device each) one engine's model is split over; rank r uses cuda:r on CUDA
    tensor_parallel_size: int = 1
    # CUDA: a split prefill's slices on a stream of their own, beside the decode steps that take turns
    # with them (SchedulerConfig.enable_split_prefill), instead of after them
    enable_split_prefill_overlap: bool = False
    # > 0: those slices run on this many of the GPU's SMs (a CUDA green context through flashinfer.green_ctx,
    # which needs cuda-python; fewer where the others round up to the driver's granularity, 8 SMs on
    # Hopper), the others kept as one group for the decode steps' kernels; 0: no partition
    split_prefill_overlap_sms: int = 0
    # with split_prefill_overlap_sms: while a slice may still run, the decode steps run on the SMs the
    # slices leave only (the split's group, a green context of its own) instead of on any SM, so that
    # they take none of the slices' SMs; with no slice in flight they run on every SM again
    split_prefill_confine_decodes: bool = False
    # CUDA: the linear layers of steps of up to 64 rows (decode batches; one row: the GEMV where chosen):
    # "cublas", or "triton"
    # (kernels.triton.small_gemm: no thread-block clusters, so beside a slice its programs take SMs
    # as the slice frees them, where a cuBLAS cluster waits for the slice's whole GEMM)
    small_batch_gemm: str = "cublas"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend must be 'auto', 'torch' or 'triton', got {self.kernel_backend!r}")
        if self.small_batch_gemm not in ("cublas", "triton"):
            raise ValueError(f"small_batch_gemm must be 'cublas' or 'triton', got {self.small_batch_gemm!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens must be >= page_size, got {self.kv_cache_tokens}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.piecewise_cuda_graph_max_tokens < 1:
            raise ValueError(f"piecewise_cuda_graph_max_tokens must be >= 1, got {self.piecewise_cuda_graph_max_tokens}")
        if self.max_context_len is not None and self.max_context_len < 2:
            raise ValueError(f"max_context_len must be >= 2, got {self.max_context_len}")
        if self.split_prefill_overlap_sms < 0:
            raise ValueError(f"split_prefill_overlap_sms must be >= 0, got {self.split_prefill_overlap_sms}")
        if self.split_prefill_overlap_sms and not self.enable_split_prefill_overlap:
            raise ValueError("split_prefill_overlap_sms partitions the SMs for enable_split_prefill_overlap: turn it on")
        if self.split_prefill_confine_decodes and not self.split_prefill_overlap_sms:
            raise ValueError("split_prefill_confine_decodes keeps the decode steps to the SMs split_prefill_overlap_sms "
                             "leaves: set it")
        if self.dllm_block_size is not None and self.dllm_block_size < 1:
            raise ValueError(f"dllm_block_size must be >= 1, got {self.dllm_block_size}")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy (CPU side): batching, chunking, mixing, caching."""

    chunked_prefill_size: int | None = 2048  # max prefill tokens per step; None: unlimited
    enable_mixed: bool = False
    max_prefill_ratio: float = 0.3  # in a MIXED step: prefill tokens / all tokens <= this
    enable_prefix_cache: bool = True
    max_running_requests: int = 256
    random_seed: int = 0  # seeds the per-request seeds drawn for unseeded requests
    # speculative decoding: None, "ngram" (prompt lookup: drafts from the request's own tokens) or
    # "draft" (a smaller model's greedy tokens, made in the engine: ``speculative_draft_model``)
    speculative_algorithm: str | None = None
    speculative_num_steps: int = 4  # k: draft tokens per request per TARGET_VERIFY step
    speculative_ngram_min: int = 1  # the shortest suffix an n-gram draft matches on
    speculative_ngram_max: int = 3  # the longest (tried first)
    # split prefill: while requests decode, a prompt of at least split_prefill_min_tokens (a chunk of
    # it with chunked prefill) runs max(1, split_prefill_token_budget // its tokens) layers a step, a
    # SPLIT_PREFILL step after each split_prefill_decode_steps decode steps (more than one: the decodes
    # keep their pace while a slice runs beside them, RunnerConfig.enable_split_prefill_overlap)
    enable_split_prefill: bool = False
    split_prefill_token_budget: int = 65536  # tokens x layers a SPLIT_PREFILL step
    split_prefill_min_tokens: int = 4096  # shorter prompts prefill as EXTEND/MIXED steps
    split_prefill_decode_steps: int = 1  # decode (or verify) steps between two slices
    # block diffusion (LowConfidence): a step unmasks every position whose probability is >= dllm_threshold,
    # at least the most confident one, and all that are left by the block's dllm_max_steps_per_block-th step
    # (None: the block size)
    dllm_threshold: float = 0.95
    dllm_max_steps_per_block: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_algorithm not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_algorithm must be None, 'ngram' or 'draft', got {self.speculative_algorithm!r}")
        if self.speculative_num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {self.speculative_num_steps}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(f"speculative_ngram_min/max need 1 <= min <= max, got "
                             f"{self.speculative_ngram_min}/{self.speculative_ngram_max}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1 or None, got {self.chunked_prefill_size}")
        if not 0.0 < self.max_prefill_ratio <= 1.0:
            raise ValueError(f"max_prefill_ratio must be in (0, 1], got {self.max_prefill_ratio}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.split_prefill_token_budget < 1:
            raise ValueError(f"split_prefill_token_budget must be >= 1, got {self.split_prefill_token_budget}")
        if self.split_prefill_min_tokens < 1:
            raise ValueError(f"split_prefill_min_tokens must be >= 1, got {self.split_prefill_min_tokens}")
        if self.split_prefill_decode_steps < 1:
            raise ValueError(f"split_prefill_decode_steps must be >= 1, got {self.split_prefill_decode_steps}")
        if not 0.0 <= self.dllm_threshold <= 1.0:
            raise ValueError(f"dllm_threshold must be in [0, 1], got {self.dllm_threshold}")
        if self.dllm_max_steps_per_block is not None and self.dllm_max_steps_per_block < 1:
            raise ValueError(f"dllm_max_steps_per_block must be >= 1, got {self.dllm_max_steps_per_block}")


@dataclass(frozen=True)
class EngineConfig:
    runner: RunnerConfig = RunnerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Split flat keyword arguments into the sub-configs; unknown names are an error."""
        runner_names = {f.name for f in dataclasses.fields(RunnerConfig)}
        sched_names = {f.name for f in dataclasses.fields(SchedulerConfig)}
        unknown = set(kwargs) - runner_names - sched_names
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        runner = RunnerConfig(**{k: v for k, v in kwargs.items() if k in runner_names})
        sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_names})
        if (sched.speculative_algorithm == "draft") != (runner.speculative_draft_model is not None):
            raise ValueError("speculative_draft_model is given exactly when speculative_algorithm is 'draft' "
                             f"(got {runner.speculative_draft_model!r} with {sched.speculative_algorithm!r})")
        return cls(runner=runner, scheduler=sched)
