"""``ForwardBatch``: the one message from scheduler to model runner (mirrored by the wire proto).

Per step it carries O(batch) data plus the tokens of this step; arrays are numpy (host) so the
scheduler never touches a device tensor and the service can move them as packed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

import numpy as np

from .forward_mode import ForwardMode
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class ReqAdmission:
    """Sent once when a request (re)enters the engine: its sampling state lives in the slot."""

    req_pool_idx: int
    sampling: SamplingParams
    seed: int
    prompt_len: int


@dataclass(frozen=True)
class SlotUpdate:
    """Set ``req_to_token[req_pool_idx, start:start+len(kv_locs)] = kv_locs`` (prefix-cache hits),
    and the token history of those positions when ``token_ids`` is given (penalties read it)."""

    req_pool_idx: int
    start: int
    kv_locs: np.ndarray  # [n] int64
    token_ids: np.ndarray | None = None  # [n] int64


class LayerRange(NamedTuple):
    """Decoder layers [begin, end) of a SPLIT_PREFILL step."""

    begin: int
    end: int


@dataclass(frozen=True)
class ForwardBatch:
    forward_mode: ForwardMode
    # per request: [B]
    req_pool_indices: np.ndarray  # int64 row in the request->slot table
    prefix_lens: np.ndarray  # int64 tokens with KV before this step
    extend_lens: np.ndarray  # int64 tokens computed this step (1 for a decode)
    sample_mask: np.ndarray  # bool: the request samples a token after this step
    # per token: [T], T = extend_lens.sum()
    input_ids: np.ndarray  # int64
    positions: np.ndarray  # int64
    out_cache_loc: np.ndarray  # int64 KV slot each token writes
    admissions: tuple[ReqAdmission, ...] = ()
    slot_updates: tuple[SlotUpdate, ...] = ()
    step: int = 0
    # DP lockstep: 0 = the engine chooses; > 0 = replay the CUDA graph of at least this many rows (all
    # ranks pad to one bucket, an IDLE rank replays padding only); -1 = eager (a rank cannot use a graph)
    padded_batch_size: int = 0
    trace_context: Mapping[str, str] = field(default_factory=dict)  # W3C traceparent/tracestate of the step
    split_layers: LayerRange | None = None  # SPLIT_PREFILL only: the layers this step runs
    # slots whose split prefill ended before its last slice's result (abort, preemption): the engine drops
    # the hidden state it keeps for them, and lets no step reuse their KV slots before the slices ran
    released_slots: tuple[int, ...] = ()

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prefix_lens + self.extend_lens

    @property
    def num_samples(self) -> int:
        return int(self.sample_mask.sum())

    def is_slice(self) -> bool:
        """A SPLIT_PREFILL step: a slice of a prefill's layers (the last one samples the first token)."""
        return self.forward_mode == ForwardMode.SPLIT_PREFILL

    def sample_token_index(self) -> np.ndarray:
        """[S] the tokens whose logits are sampled: a request's last with ``sample_mask`` set, or every
        token of a TARGET_VERIFY step."""
        if self.forward_mode == ForwardMode.TARGET_VERIFY:
            return np.arange(self.num_tokens, dtype=np.int64)
        return (np.cumsum(self.extend_lens) - 1)[self.sample_mask]

    def sample_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(request slot [S], position of the token sampled [S]) of each ``sample_token_index`` row."""
        if self.forward_mode == ForwardMode.TARGET_VERIFY:
            return np.repeat(self.req_pool_indices, self.extend_lens), self.positions + 1
        mask = self.sample_mask
        return self.req_pool_indices[mask], self.seq_lens[mask]

    @classmethod
    def idle(cls, step: int = 0) -> ForwardBatch:
        empty = np.zeros(0, dtype=np.int64)
        return cls(ForwardMode.IDLE, empty, empty, empty, np.zeros(0, dtype=bool), empty, empty, empty, step=step)


@dataclass(frozen=True)
class ForwardResult:
    """Sampled tokens for the requests with ``sample_mask`` set, in batch order."""

    next_token_ids: np.ndarray  # [S] int64
    logprobs: np.ndarray | None = None  # [S] float32, chosen token
    top_logprob_ids: np.ndarray | None = None  # [S, n] int64
    top_logprob_values: np.ndarray | None = None  # [S, n] float32
    # TARGET_VERIFY: next_token_ids is the target's token after every input token [T]; request r keeps
    # its first accepted_lengths[r] drafts and the token after them (its run's first
    # accepted_lengths[r] + 1 tokens)
    accepted_lengths: np.ndarray | None = None  # [B] int64
    # DLLM_EXTEND: next_token_ids is the token chosen at every position of each sampled row's block, this
    # its probability [S * block size] float32
    confidences: np.ndarray | None = None
    cuda_graph_bucket: int | None = None  # the CUDA-graph bucket the step replayed; None: it ran eagerly
    forward_seconds: float = 0.0  # the engine's time for the step (set where the step loop times it)
