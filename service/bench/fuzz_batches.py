"""Random and mutated ``ForwardBatch``es for ``Engine.Forward`` (``hypothesis`` strategies), shared by
the fuzz tests and ``modeserve bench fuzz``: every field drawn on its own, batches whose shapes agree
but for at most one field, and valid batches with one to three fields mutated. Values straddle the
engine's bounds (``BatchLimits``): the edges of each range, of int32 and of int64."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
from hypothesis import strategies as st

from ...proto.v1 import forward_pb2
from ..rpc.batch_checks import BatchLimits

ARRAY_FIELDS = ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc")


def i64(values: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _int64s(limit: int, bits: int = 64) -> st.SearchStrategy[int]:
    """Values at the edges of [0, limit) and of int32/int64, near the range, or anywhere (in ``bits``)."""
    lo, hi = -2**(bits - 1), 2**(bits - 1) - 1
    edges = [v for v in (lo, -2**31, -1, 0, 1, limit - 1, limit, limit + 1, 2**31, hi) if lo <= v <= hi]
    return st.sampled_from(edges) | st.integers(-2, limit + 2) | st.integers(lo, hi)


def _packed(limit: int, max_size: int = 12) -> st.SearchStrategy[bytes]:
    """An int64 LE array, or bytes of any length (not a whole number of int64s, often)."""
    return st.lists(_int64s(limit), max_size=max_size).map(i64) | st.binary(max_size=8 * max_size)


_floats = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1.0, 1e30]) | st.floats(-3, 3, width=32)
_slot_sampling = st.builds(forward_pb2.SlotSampling, temperature=_floats, top_p=_floats,
                           top_k=st.integers(-2**31, 2**31 - 1), min_p=_floats, frequency_penalty=_floats,
                           presence_penalty=_floats, repetition_penalty=_floats,
                           logprobs=st.integers(-2, 25) | st.integers(-2**31, 2**31 - 1))


def _admissions(limits: BatchLimits) -> st.SearchStrategy[forward_pb2.ReqAdmission]:
    return st.builds(forward_pb2.ReqAdmission, req_pool_idx=_int64s(limits.max_reqs),
                     sampling=st.none() | _slot_sampling, seed=st.integers(0, 2**64 - 1),
                     prompt_len=_int64s(limits.max_context))


def _slot_updates(limits: BatchLimits) -> st.SearchStrategy[forward_pb2.SlotUpdate]:
    return st.builds(forward_pb2.SlotUpdate, req_pool_idx=_int64s(limits.max_reqs),
                     start=_int64s(limits.max_context), kv_locs=_packed(limits.num_kv_slots),
                     token_ids=_packed(limits.vocab_size))


def _modes() -> st.SearchStrategy[int]:
    return st.integers(0, 9) | st.integers(-2**31, 2**31 - 1)


def random_batches(limits: BatchLimits) -> st.SearchStrategy[forward_pb2.ForwardBatch]:
    """Every field drawn on its own: lengths rarely agree, values anywhere."""
    return st.builds(
        forward_pb2.ForwardBatch, step=st.integers(0, 2**64 - 1), forward_mode=_modes(),
        req_pool_indices=_packed(limits.max_reqs), prefix_lens=_packed(limits.max_context),
        extend_lens=_packed(limits.max_context), sample_mask=st.binary(max_size=8),
        input_ids=_packed(limits.vocab_size), positions=_packed(limits.max_context),
        out_cache_loc=_packed(limits.num_kv_slots), admissions=st.lists(_admissions(limits), max_size=2),
        slot_updates=st.lists(_slot_updates(limits), max_size=2),
        trace_context=st.dictionaries(st.text(max_size=12), st.text(max_size=60), max_size=2),
        padded_batch_size=_int64s(limits.max_reqs, bits=32))


def _valid_admissions(limits: BatchLimits) -> st.SearchStrategy[forward_pb2.ReqAdmission]:
    sampling = st.builds(forward_pb2.SlotSampling, temperature=st.floats(0, 2, width=32),
                         top_p=st.floats(0.125, 1, width=32), top_k=st.integers(-1, 2 * limits.vocab_size),
                         min_p=st.floats(0, 1, width=32), frequency_penalty=st.floats(-2, 2, width=32),
                         presence_penalty=st.floats(-2, 2, width=32), repetition_penalty=st.floats(0.5, 2, width=32),
                         logprobs=st.integers(-1, 20))
    return st.builds(forward_pb2.ReqAdmission, req_pool_idx=st.integers(0, limits.max_reqs - 1), sampling=sampling,
                     seed=st.integers(0, 2**64 - 1), prompt_len=st.integers(0, limits.max_context))


@st.composite
def shaped_batches(draw: st.DrawFn, limits: BatchLimits) -> forward_pb2.ForwardBatch:
    """Lengths that agree and values in range but for at most one field (``broken``), so that most
    batches reach the runner: any supported mode, any rows, positions and KV slots."""
    broken = draw(st.sampled_from([None] * 6 + ["mode", "rows", "prefix", "ext", "mask", "ids", "locs", "positions",
                                                "padded", "admissions"]))
    decode, verify = forward_pb2.FORWARD_MODE_DECODE, forward_pb2.FORWARD_MODE_TARGET_VERIFY
    mode = draw(_modes() if broken == "mode" else st.sampled_from(range(1, 6)))  # EXTEND .. TARGET_VERIFY
    idle = mode == forward_pb2.FORWARD_MODE_IDLE
    num_reqs = draw(st.integers(0 if broken or idle else 1, 0 if idle and not broken else min(limits.max_reqs, 4)))

    def each(ok: st.SearchStrategy[int], bad: st.SearchStrategy[int], field: str, n: int = num_reqs) -> list[int]:
        return draw(st.lists(bad if broken == field else ok, min_size=n, max_size=n))

    rows = each(st.nothing(), st.integers(-1, limits.max_reqs), "rows") if broken == "rows" else draw(
        st.permutations(range(limits.max_reqs)))[:num_reqs]
    prefix = each(st.integers(0, 12) | st.integers(0, limits.max_context - 6),
                  st.integers(-1, limits.max_context + 1), "prefix")
    ext = each(st.just(1) if mode == decode else st.integers(1 if mode == verify else 0, 6), st.integers(0, 6), "ext")
    samples = each(st.booleans(), st.booleans(), "")  # which requests sample (in DECODE: all of them)
    mask = each(st.nothing(), st.integers(0, 255), "mask") if broken == "mask" else [
        int(e > 0 and (mode == decode or s)) for e, s in zip(ext, samples)]
    num_tokens = sum(ext)
    positions = [p + j for p, e in zip(prefix, ext) for j in range(e)]
    if broken == "positions" and num_tokens:
        positions[draw(st.integers(0, num_tokens - 1))] += draw(st.sampled_from([-1, 1, 2**40]))
    ids = each(st.integers(-1, limits.vocab_size - 1), _int64s(limits.vocab_size), "ids", num_tokens)
    locs = each(st.integers(0, limits.num_kv_slots - 1), _int64s(limits.num_kv_slots), "locs", num_tokens)
    return forward_pb2.ForwardBatch(
        step=draw(st.integers(0, 100)), forward_mode=mode,  # type: ignore[arg-type]  # an open enum
        req_pool_indices=i64(rows), prefix_lens=i64(prefix), extend_lens=i64(ext), sample_mask=bytes(mask),
        input_ids=i64(ids), positions=i64(positions), out_cache_loc=i64(locs),
        admissions=draw(st.lists(_admissions(limits) if broken == "admissions" else _valid_admissions(limits),
                                 max_size=2)),
        slot_updates=draw(st.lists(_slot_updates(limits), max_size=1 if broken else 0)),
        padded_batch_size=draw(_int64s(limits.max_reqs, bits=32) if broken == "padded"
                               else st.integers(-1, limits.max_reqs)))


def _mutate_array(draw: st.DrawFn, m: forward_pb2.ForwardBatch, limits: BatchLimits) -> None:
    name = draw(st.sampled_from(ARRAY_FIELDS + ("sample_mask",)))
    dtype = np.dtype("u1" if name == "sample_mask" else "<i8")
    data = getattr(m, name)
    a = np.frombuffer(data[: len(data) - len(data) % dtype.itemsize], dtype=dtype).astype(np.int64)
    value = draw(_int64s(max(limits.max_reqs, limits.max_context, limits.num_kv_slots, limits.vocab_size)))
    op = draw(st.sampled_from(["set", "drop", "append", "empty", "shift", "reverse", "bytes"]))
    if op == "set" and a.size:
        a[draw(st.integers(0, a.size - 1))] = value
    elif op in ("drop", "append", "empty", "reverse"):
        a = {"drop": a[:-1], "append": np.append(a, value), "empty": a[:0], "reverse": a[::-1]}[op]
    elif op == "shift":
        a = a + draw(st.sampled_from([-1, 1, 16]))
    if op == "bytes":
        setattr(m, name, draw(st.binary(max_size=40)))
    else:  # a sample mask byte wraps around
        setattr(m, name, (a % 256 if dtype.itemsize == 1 else a).astype(dtype).tobytes())


def _mutate_scalar(draw: st.DrawFn, m: forward_pb2.ForwardBatch, limits: BatchLimits) -> None:
    name = draw(st.sampled_from(["forward_mode", "padded_batch_size", "step"]))
    if name == "forward_mode":
        m.forward_mode = draw(_modes())  # type: ignore[assignment]  # an open enum: any int32 travels
    elif name == "padded_batch_size":
        m.padded_batch_size = draw(_int64s(limits.max_reqs, bits=32))
    else:
        m.step = draw(st.integers(0, 2**64 - 1))


def _mutate_admission(draw: st.DrawFn, m: forward_pb2.ForwardBatch, limits: BatchLimits) -> None:
    if not m.admissions or draw(st.booleans()):
        m.admissions.append(draw(_admissions(limits)))
        return
    a = m.admissions[draw(st.integers(0, len(m.admissions) - 1))]
    name = draw(st.sampled_from(["req_pool_idx", "prompt_len", "sampling", "clear", "top_k", "logprobs"]))
    if name in ("req_pool_idx", "prompt_len"):
        setattr(a, name, draw(_int64s(limits.max_reqs if name == "req_pool_idx" else limits.max_context)))
    elif name == "sampling":
        a.sampling.CopyFrom(draw(_slot_sampling))
    elif name == "clear":
        a.ClearField("sampling")
    else:
        setattr(a.sampling, name, draw(st.integers(-2**31, 2**31 - 1)))


def _mutate_slot_update(draw: st.DrawFn, m: forward_pb2.ForwardBatch, limits: BatchLimits) -> None:
    if not m.slot_updates or draw(st.booleans()):
        m.slot_updates.append(draw(_slot_updates(limits)))
        return
    u = m.slot_updates[draw(st.integers(0, len(m.slot_updates) - 1))]
    name = draw(st.sampled_from(["req_pool_idx", "start", "kv_locs", "token_ids"]))
    if name in ("kv_locs", "token_ids"):
        setattr(u, name, draw(_packed(limits.num_kv_slots if name == "kv_locs" else limits.vocab_size)))
    else:
        setattr(u, name, draw(_int64s(limits.max_reqs if name == "req_pool_idx" else limits.max_context)))


def _mutate_trace(draw: st.DrawFn, m: forward_pb2.ForwardBatch, limits: BatchLimits) -> None:
    m.trace_context.clear()
    m.trace_context.update(draw(st.dictionaries(st.sampled_from(["traceparent", "tracestate", "x"]) | st.text(),
                                                st.text(max_size=80), max_size=2)))


MUTATIONS: tuple[Callable[[st.DrawFn, forward_pb2.ForwardBatch, BatchLimits], None], ...] = (
    _mutate_array, _mutate_array, _mutate_array, _mutate_scalar, _mutate_admission, _mutate_slot_update,
    _mutate_trace)


@st.composite
def mutated_batches(draw: st.DrawFn, valid: Sequence[forward_pb2.ForwardBatch],
                    limits: BatchLimits) -> list[forward_pb2.ForwardBatch]:
    """One stream's batches: a valid batch with one to three fields mutated, after the valid batch that
    came before it when ``draw`` says so (so that a step is in flight when the bad one arrives)."""
    k = draw(st.integers(0, len(valid) - 1))
    m = forward_pb2.ForwardBatch()
    m.CopyFrom(valid[k])
    for _ in range(draw(st.integers(1, 3))):
        draw(st.sampled_from(MUTATIONS))(draw, m, limits)
    return [*(valid[k - 1:k] if k and draw(st.booleans()) else []), m]
