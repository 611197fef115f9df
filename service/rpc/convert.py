"""Wire form <-> engine form of a step: the one place ``forward_pb2`` meets ``ForwardBatch``.

Arrays travel as packed little-endian bytes and are decoded with ``np.frombuffer`` (zero-copy,
read-only views of the message's bytes). Decoding a batch validates everything the runner indexes
with (``batch_checks``), so a bad batch is a ``ValueError`` naming the field instead of a device
fault or a corrupted slot table.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable

import numpy as np

from ...engine.forward_batch import ForwardBatch, ForwardResult, LayerRange, ReqAdmission, SlotUpdate
from ...engine.forward_mode import ForwardMode
from ...engine.sampling_params import SamplingParams
from ...engine.scheduler.stats import ForwardModeStats
from ...proto.v1 import forward_pb2, generate_pb2
from .batch_checks import BatchLimits, check_range, check_requests, check_slot, check_tokens

_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_NO_LOGPROBS = -1


def _pack(a: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def _unpack(data: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ValueError(f"{field}: {len(data)} bytes is not a multiple of {dtype.itemsize} ({dtype.name})")
    return np.frombuffer(data, dtype=dtype)


def _sampling_to_proto(sp: SamplingParams) -> forward_pb2.SlotSampling:
    return forward_pb2.SlotSampling(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=min(max(sp.top_k, _INT32_MIN), _INT32_MAX),  # the sampler clamps to the vocabulary
        min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty,
        logprobs=_NO_LOGPROBS if sp.logprobs is None else sp.logprobs,
    )


def _sampling_from_proto(s: forward_pb2.SlotSampling, field: str) -> SamplingParams:
    """The engine-side params: only what ``SlotState.admit`` reads; the rest (stop conditions,
    ``max_new_tokens``, ``seed`` — it travels in the admission) is scheduler business and defaults."""
    floats = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
    for name in floats:
        if not math.isfinite(getattr(s, name)):
            raise ValueError(f"{field}.{name} must be finite, got {getattr(s, name)}")
    try:
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                              frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                              repetition_penalty=s.repetition_penalty,
                              logprobs=None if s.logprobs == _NO_LOGPROBS else s.logprobs)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def batch_to_proto(b: ForwardBatch) -> forward_pb2.ForwardBatch:
    return forward_pb2.ForwardBatch(
        step=b.step,
        padded_batch_size=b.padded_batch_size,
        trace_context=dict(b.trace_context),
        forward_mode=_mode_to_proto(b.forward_mode),
        split_layer_begin=b.split_layers.begin if b.split_layers is not None else 0,
        split_layer_end=b.split_layers.end if b.split_layers is not None else 0,
        released_slots=_pack(np.asarray(b.released_slots, dtype=np.int64), _I64),
        req_pool_indices=_pack(b.req_pool_indices, _I64),
        prefix_lens=_pack(b.prefix_lens, _I64),
        extend_lens=_pack(b.extend_lens, _I64),
        sample_mask=_pack(b.sample_mask, _U8),
        input_ids=_pack(b.input_ids, _I64),
        positions=_pack(b.positions, _I64),
        out_cache_loc=_pack(b.out_cache_loc, _I64),
        admissions=[
            forward_pb2.ReqAdmission(req_pool_idx=a.req_pool_idx, sampling=_sampling_to_proto(a.sampling),
                                     seed=a.seed, prompt_len=a.prompt_len)
            for a in b.admissions
        ],
        slot_updates=[
            forward_pb2.SlotUpdate(req_pool_idx=u.req_pool_idx, start=u.start, kv_locs=_pack(u.kv_locs, _I64),
                                   token_ids=b"" if u.token_ids is None else _pack(u.token_ids, _I64))
            for u in b.slot_updates
        ],
    )


def _mode_to_proto(mode: ForwardMode) -> forward_pb2.ForwardMode:
    """The wire enum numbers the modes as ``ForwardMode`` does (a test checks every name)."""
    return forward_pb2.ForwardMode.Value(f"FORWARD_MODE_{mode.name}")


def _mode_from_proto(value: int) -> ForwardMode:
    if value == forward_pb2.FORWARD_MODE_UNSPECIFIED:
        raise ValueError("forward_mode is unspecified (0); set the step's mode")
    try:
        return ForwardMode(value)  # a known but unimplemented mode converts; the runner refuses it
    except ValueError:
        known = ", ".join(f"{m.name}={int(m)}" for m in ForwardMode)
        raise ValueError(f"forward_mode {value} is not a forward mode (known: {known})") from None


def _admissions_from_proto(m: forward_pb2.ForwardBatch, limits: BatchLimits) -> tuple[ReqAdmission, ...]:
    out = []
    for i, a in enumerate(m.admissions):
        field = f"admissions[{i}]"
        check_slot(a.req_pool_idx, field, limits)
        if not 0 <= a.prompt_len <= limits.max_context:
            raise ValueError(f"{field}.prompt_len = {a.prompt_len} is outside [0, {limits.max_context}]")
        if not a.HasField("sampling"):
            raise ValueError(f"{field}.sampling is missing")
        sampling = _sampling_from_proto(a.sampling, f"{field}.sampling")
        out.append(ReqAdmission(a.req_pool_idx, sampling, a.seed, a.prompt_len))
    return tuple(out)


def _slot_updates_from_proto(m: forward_pb2.ForwardBatch, limits: BatchLimits) -> tuple[SlotUpdate, ...]:
    out = []
    for i, u in enumerate(m.slot_updates):
        field = f"slot_updates[{i}]"
        check_slot(u.req_pool_idx, field, limits)
        locs = _unpack(u.kv_locs, _I64, f"{field}.kv_locs")
        if not 0 <= u.start <= limits.max_context - locs.shape[0]:
            raise ValueError(f"{field}: start {u.start} + {locs.shape[0]} kv_locs does not fit in "
                             f"max_context {limits.max_context}")
        check_range(locs, 0, limits.num_kv_slots, f"{field}.kv_locs")
        ids = None
        if u.token_ids:
            ids = _unpack(u.token_ids, _I64, f"{field}.token_ids")
            if ids.shape != locs.shape:
                raise ValueError(f"{field}: {ids.shape[0]} token_ids for {locs.shape[0]} kv_locs")
            check_range(ids, 0, limits.vocab_size, f"{field}.token_ids")
        out.append(SlotUpdate(u.req_pool_idx, u.start, locs, ids))
    return tuple(out)


def batch_from_proto(m: forward_pb2.ForwardBatch, limits: BatchLimits) -> ForwardBatch:
    """Decode and validate; ``ValueError`` naming the field for anything the runner must not see."""
    mode = _mode_from_proto(m.forward_mode)
    req_pool = _unpack(m.req_pool_indices, _I64, "req_pool_indices")
    prefix = _unpack(m.prefix_lens, _I64, "prefix_lens")
    ext = _unpack(m.extend_lens, _I64, "extend_lens")
    mask = _unpack(m.sample_mask, _U8, "sample_mask")
    ids = _unpack(m.input_ids, _I64, "input_ids")
    pos = _unpack(m.positions, _I64, "positions")
    loc = _unpack(m.out_cache_loc, _I64, "out_cache_loc")
    check_requests(mode, req_pool, prefix, ext, mask, limits)
    check_tokens(prefix, ext, ids, pos, loc, limits)
    if not -1 <= m.padded_batch_size <= limits.max_reqs:
        raise ValueError(f"padded_batch_size = {m.padded_batch_size} is outside [-1, {limits.max_reqs}]")
    released = _unpack(m.released_slots, _I64, "released_slots")
    check_range(released, 0, limits.max_reqs, "released_slots")
    return ForwardBatch(
        forward_mode=mode,
        req_pool_indices=req_pool,
        prefix_lens=prefix,
        extend_lens=ext,
        sample_mask=mask.view(np.bool_),  # values checked to be 0/1
        input_ids=ids,
        positions=pos,
        out_cache_loc=loc,
        admissions=_admissions_from_proto(m, limits),
        slot_updates=_slot_updates_from_proto(m, limits),
        step=m.step,
        padded_batch_size=m.padded_batch_size,
        trace_context=dict(m.trace_context),
        split_layers=_split_layers(mode, m, limits),
        released_slots=tuple(released.tolist()),
    )


def _split_layers(mode: ForwardMode, m: forward_pb2.ForwardBatch, limits: BatchLimits) -> LayerRange | None:
    """A SPLIT_PREFILL step's layer range, within the model's layers; other modes carry none."""
    begin, end = m.split_layer_begin, m.split_layer_end
    if mode != ForwardMode.SPLIT_PREFILL:
        if begin or end:
            raise ValueError(f"split_layer_begin/end = {begin}/{end}: only a SPLIT_PREFILL step runs a layer range")
        return None
    if not 0 <= begin < end <= limits.num_layers:
        raise ValueError(f"forward_mode SPLIT_PREFILL: layers [{begin}, {end}) are not a range within "
                         f"[0, {limits.num_layers})")
    return LayerRange(begin, end)


def result_to_proto(r: ForwardResult, step: int) -> forward_pb2.ForwardResult:
    m = forward_pb2.ForwardResult(step=step, next_token_ids=_pack(r.next_token_ids, _I64),
                                  forward_seconds=r.forward_seconds)
    if r.cuda_graph_bucket is not None:
        m.cuda_graph_bucket = r.cuda_graph_bucket
    if r.accepted_lengths is not None:
        m.accepted_lengths = _pack(r.accepted_lengths, _I64)
    if r.confidences is not None:
        m.confidences = _pack(r.confidences, _F32)
    if r.logprobs is not None:
        m.logprobs = _pack(r.logprobs, _F32)
        if r.top_logprob_ids is not None and r.top_logprob_values is not None:
            m.top_n = int(r.top_logprob_ids.shape[1])
            m.top_logprob_ids = _pack(r.top_logprob_ids, _I64)
            m.top_logprob_values = _pack(r.top_logprob_values, _F32)
    return m


def result_from_proto(m: forward_pb2.ForwardResult) -> ForwardResult:
    """Decode an engine's answer; ``ValueError`` when its arrays disagree in length."""
    out = ForwardResult(
        next_token_ids=_unpack(m.next_token_ids, _I64, "next_token_ids"),
        accepted_lengths=_unpack(m.accepted_lengths, _I64, "accepted_lengths") if m.accepted_lengths else None,
        cuda_graph_bucket=m.cuda_graph_bucket if m.HasField("cuda_graph_bucket") else None,
        forward_seconds=m.forward_seconds)
    if m.confidences:
        confidences = _unpack(m.confidences, _F32, "confidences")
        if confidences.shape != out.next_token_ids.shape:
            raise ValueError(f"confidences has {confidences.shape[0]} entries but next_token_ids has "
                             f"{out.next_token_ids.shape[0]}")
        out = replace(out, confidences=confidences)
    if not m.logprobs:
        return out
    num_samples = out.next_token_ids.shape[0]
    logprobs = _unpack(m.logprobs, _F32, "logprobs")
    if logprobs.shape[0] != num_samples:
        raise ValueError(f"logprobs has {logprobs.shape[0]} entries but next_token_ids has {num_samples}")
    if m.top_n < 0:
        raise ValueError(f"top_n must be >= 0, got {m.top_n}")
    top_ids = _unpack(m.top_logprob_ids, _I64, "top_logprob_ids")
    top_values = _unpack(m.top_logprob_values, _F32, "top_logprob_values")
    for name, arr in (("top_logprob_ids", top_ids), ("top_logprob_values", top_values)):
        if arr.shape[0] != num_samples * m.top_n:
            raise ValueError(f"{name} has {arr.shape[0]} entries, expected {num_samples} x top_n {m.top_n}")
    return replace(out, logprobs=logprobs, top_logprob_ids=top_ids.reshape(num_samples, m.top_n),
                   top_logprob_values=top_values.reshape(num_samples, m.top_n))


def mode_stats_to_proto(stats: Iterable[ForwardModeStats]) -> list[generate_pb2.ModeStat]:
    """Per-mode totals summed over ``stats`` (one per rank), in ForwardMode order."""
    total: dict[str, list[float]] = {}
    for st in stats:
        for mode, n in list(st.mode_counts.items()):
            row = total.setdefault(mode, [0, 0, 0, 0.0])
            row[0] += n
            row[1] += st.mode_tokens.get(mode, 0)
            row[2] += st.mode_requests.get(mode, 0)
            row[3] += st.mode_seconds.get(mode, 0.0)
    order = {m.name: int(m) for m in ForwardMode}
    return [generate_pb2.ModeStat(mode=m, steps=int(r[0]), tokens=int(r[1]), requests=int(r[2]), seconds=r[3])
            for m, r in sorted(total.items(), key=lambda kv: order.get(kv[0], 99))]
