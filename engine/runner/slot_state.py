"""Per-slot request state on the engine: the request->token-slot table and sampling parameters.

Everything here can be rebuilt from what the scheduler holds (tokens and params), so the engine
keeps no scheduling state. Rows are indexed by ``req_pool_idx``.
"""

from __future__ import annotations

import numpy as np
import torch

from modeserve.engine.forward_batch import ReqAdmission, SlotUpdate
from modeserve.engine.runner.sampler import SamplingTensors


class SlotState:
    def __init__(self, max_reqs: int, max_context: int, device: torch.device) -> None:
        self.device = device
        # [max_reqs, max_context]: KV slot and token id at each position of each request
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int64, device=device)
        self.token_ids = torch.zeros(max_reqs, max_context, dtype=torch.int64, device=device)
        # [max_reqs]: the token each slot sampled last; resolves input id -1 (overlap placeholders)
        self.last_token = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self.temperature = np.ones(max_reqs, dtype=np.float32)
        self.top_p = np.ones(max_reqs, dtype=np.float32)
        self.top_k = np.full(max_reqs, -1, dtype=np.int64)
        self.min_p = np.zeros(max_reqs, dtype=np.float32)
        self.seed = np.zeros(max_reqs, dtype=np.int64)
        self.frequency_penalty = np.zeros(max_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_reqs, dtype=np.float32)
        self.top_n = np.zeros(max_reqs, dtype=np.int64)
        self.prompt_len = np.zeros(max_reqs, dtype=np.int64)

    def admit(self, adm: ReqAdmission) -> None:
        i, sp = adm.req_pool_idx, adm.sampling
        self.temperature[i] = sp.temperature
        self.top_p[i] = sp.top_p
        self.top_k[i] = sp.top_k
        self.min_p[i] = sp.min_p
        self.seed[i] = np.uint64(adm.seed).astype(np.int64)
        self.frequency_penalty[i] = sp.frequency_penalty
        self.presence_penalty[i] = sp.presence_penalty
        self.repetition_penalty[i] = sp.repetition_penalty
        self.top_n[i] = -1 if sp.logprobs is None else sp.logprobs
        self.prompt_len[i] = adm.prompt_len

    def update(self, upd: SlotUpdate) -> None:
        locs = torch.from_numpy(upd.kv_locs).to(self.device)
        self.req_to_token[upd.req_pool_idx, upd.start : upd.start + locs.numel()] = locs

    def record(self, rows: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Write this step's KV slots and token ids; returns ids with placeholders (-1) resolved."""
        # rows/positions/loc/ids: [T]
        ids = torch.where(ids < 0, self.last_token[rows], ids)
        self.req_to_token[rows, positions] = loc
        self.token_ids[rows, positions] = ids
        return ids

    def sampling_tensors(self, slots: np.ndarray, seq_lens: np.ndarray) -> tuple[SamplingTensors, bool]:
        """Tensors for the sampling rows ``slots`` (next token at position ``seq_lens``), and whether
        any row wants log-probabilities."""

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        temp = self.temperature[slots]
        freq, pres, rep = self.frequency_penalty[slots], self.presence_penalty[slots], self.repetition_penalty[slots]
        tensors = SamplingTensors(
            temperatures=dev(temp),
            top_ps=dev(self.top_p[slots]),
            top_ks=dev(self.top_k[slots]),
            min_ps=dev(self.min_p[slots]),
            seeds=dev(self.seed[slots]),
            positions=dev(seq_lens.astype(np.int64)),
            frequency_penalties=dev(freq),
            presence_penalties=dev(pres),
            repetition_penalties=dev(rep),
            any_penalties=bool((freq != 0).any() or (pres != 0).any() or (rep != 1).any()),
            all_greedy=bool((temp == 0).all()),
            max_top_n=int(self.top_n[slots].max(initial=0)),
        )
        return tensors, bool((self.top_n[slots] >= 0).any())
