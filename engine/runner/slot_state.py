"""Per-slot request state on the engine: the request->token-slot table and sampling parameters.

Everything here can be rebuilt from what the scheduler holds (tokens and params), so the engine
keeps no scheduling state. Rows are indexed by ``req_pool_idx``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..forward_batch import ReqAdmission, SlotUpdate
from .host_io import upload
from .sampler import SamplingTensors
from ...kernels import ops


class SlotState:
    def __init__(self, max_reqs: int, max_context: int, device: torch.device, page_size: int = 1,
                 record_tokens: Callable[..., None] = ops.record_tokens) -> None:
        """``record_tokens``: the op ``record`` runs (``kernels.ops.record_tokens`` or a kernel of its contract)."""
        self.device = device
        self._record_tokens = record_tokens
        self.page_size = page_size
        # [max_reqs, max_context]: KV slot and token id at each position of each request
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int64, device=device)
        # host mirror by page, [max_reqs, ceil(max_context / page_size)]: attention planning reads it
        # without touching the device (a request's positions [k*ps, (k+1)*ps) share one page)
        self.req_to_page = np.zeros((max_reqs, -(-max_context // page_size)), dtype=np.int32)
        self.token_ids = torch.zeros(max_reqs, max_context, dtype=torch.int64, device=device)
        # [max_reqs]: the token each slot sampled last; resolves input id -1 (overlap placeholders)
        self.last_token = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        # [max_reqs]: a slot's token count after its last TARGET_VERIFY step (chained verify rows start
        # from it: ``chained_verify``)
        self.fill_len = torch.zeros(max_reqs, dtype=torch.int64, device=device)
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
        n = len(upd.kv_locs)
        (locs,) = upload([upd.kv_locs], self.device)
        self.req_to_token[upd.req_pool_idx, upd.start : upd.start + n] = locs
        if upd.token_ids is not None:
            (ids,) = upload([upd.token_ids], self.device)
            self.token_ids[upd.req_pool_idx, upd.start : upd.start + n] = ids
        pos = np.arange(upd.start, upd.start + n)
        self.req_to_page[upd.req_pool_idx, pos // self.page_size] = upd.kv_locs // self.page_size

    def record_pages(self, rows: np.ndarray, positions: np.ndarray, loc: np.ndarray) -> None:
        """Host mirror of ``record``'s KV slots. rows/positions/loc: [T] int64."""
        self.req_to_page[rows, positions // self.page_size] = loc // self.page_size

    def record(self, rows: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor, ids: torch.Tensor) -> None:
        """Write this step's KV slots and token ids; resolves placeholders (-1) in ``ids`` in place.
        rows/positions/loc/ids: [T] int64 (device)."""
        self._record_tokens(self.req_to_token, self.token_ids, self.last_token, rows, positions, loc, ids)

    def is_plain_greedy(self, slots: np.ndarray) -> bool:
        """Every row greedy, without penalties or logprobs: sampling is one argmax."""
        return bool((self.temperature[slots] == 0).all() and (self.frequency_penalty[slots] == 0).all()
                    and (self.presence_penalty[slots] == 0).all() and (self.repetition_penalty[slots] == 1).all()
                    and (self.top_n[slots] < 0).all())

    def sampling_tensors(self, slots: np.ndarray, seq_lens: np.ndarray) -> tuple[SamplingTensors, bool]:
        """Tensors for the sampling rows ``slots`` (next token at position ``seq_lens``), and whether
        any row wants log-probabilities."""

        temp = self.temperature[slots]
        freq, pres, rep = self.frequency_penalty[slots], self.presence_penalty[slots], self.repetition_penalty[slots]
        floats = upload([temp, self.top_p[slots], self.min_p[slots], freq, pres, rep], self.device, torch.float32)
        ints = upload([self.top_k[slots], self.seed[slots], seq_lens], self.device)
        tensors = SamplingTensors(
            temperatures=floats[0],
            top_ps=floats[1],
            top_ks=ints[0],
            min_ps=floats[2],
            seeds=ints[1],
            positions=ints[2],
            frequency_penalties=floats[3],
            presence_penalties=floats[4],
            repetition_penalties=floats[5],
            any_penalties=bool((freq != 0).any() or (pres != 0).any() or (rep != 1).any()),
            all_greedy=bool((temp == 0).all()),
            max_top_n=int(self.top_n[slots].max(initial=0)),
        )
        return tensors, bool((self.top_n[slots] >= 0).any())
