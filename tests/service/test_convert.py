"""Proto <-> engine conversion: round trips of the batches a real Scheduler builds, and every
malformed batch rejected with a ValueError that names the field."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import pytest

from modeserve.engine.config import SchedulerConfig
from modeserve.engine.forward_batch import ForwardBatch, ForwardResult
from modeserve.engine.forward_mode import ForwardMode
from modeserve.engine.request import Req
from modeserve.engine.sampling_params import SamplingParams
from modeserve.engine.scheduler.create import create_scheduler
from modeserve.engine.scheduler.scheduler import Scheduler
from modeserve.proto.v1 import forward_pb2
from modeserve.service.rpc.batch_checks import BatchLimits
from modeserve.service.rpc.convert import (
    batch_from_proto,
    batch_to_proto,
    result_from_proto,
    result_to_proto,
)

VOCAB = 100
PAGE = 4
NUM_PAGES = 64
MAX_CONTEXT = 64
MAX_REQS = 8
LIMITS = BatchLimits(max_reqs=MAX_REQS, max_context=MAX_CONTEXT, num_kv_slots=NUM_PAGES * PAGE, vocab_size=VOCAB,
                     num_layers=4)
PER_REQUEST = ("req_pool_indices", "prefix_lens", "extend_lens", "sample_mask")
PER_TOKEN = ("input_ids", "positions", "out_cache_loc")
SLOT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
               "repetition_penalty", "logprobs")


def make_scheduler(**cfg: object) -> Scheduler:
    config = SchedulerConfig(**{"max_running_requests": MAX_REQS, **cfg})
    return create_scheduler(config, num_pages=NUM_PAGES, page_size=PAGE, max_context=MAX_CONTEXT, vocab_size=VOCAB,
                     eos_token_ids=(2,), num_layers=LIMITS.num_layers)


def add(s: Scheduler, rid: str, prompt: list[int], **sp: object) -> Req:
    params = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True, **sp})
    req = s.make_request(rid, prompt, params)
    s.add_request(req)
    return req


def fake_result(batch: ForwardBatch, top_n: int | None) -> ForwardResult:
    n = batch.num_samples
    ids = (np.arange(n, dtype=np.int64) * 7 + batch.step) % (VOCAB - 3) + 3
    if top_n is None:
        return ForwardResult(ids)
    lp = -np.arange(1, n + 1, dtype=np.float32) / 3
    top_ids = np.arange(n * top_n, dtype=np.int64).reshape(n, top_n) % VOCAB
    return ForwardResult(ids, lp, top_ids, np.full((n, top_n), -0.5, dtype=np.float32))


def assert_same_batch(got: ForwardBatch, want: ForwardBatch) -> None:
    assert got.forward_mode == want.forward_mode and got.step == want.step
    for name in PER_REQUEST + PER_TOKEN:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype, name
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert len(got.admissions) == len(want.admissions)
    for ga, wa in zip(got.admissions, want.admissions):
        assert (ga.req_pool_idx, ga.seed, ga.prompt_len) == (wa.req_pool_idx, wa.seed, wa.prompt_len)
        for f in SLOT_FIELDS:  # what SlotState.admit reads; floats travel as float32
            gv, wv = getattr(ga.sampling, f), getattr(wa.sampling, f)
            assert gv == (np.float32(wv) if isinstance(wv, float) else wv), f
    assert [(u.req_pool_idx, u.start, u.kv_locs.tolist()) for u in got.slot_updates] == \
           [(u.req_pool_idx, u.start, u.kv_locs.tolist()) for u in want.slot_updates]
    assert (got.split_layers, got.released_slots) == (want.split_layers, want.released_slots)


def wire(b: ForwardBatch) -> forward_pb2.ForwardBatch:
    """Encode and go through real serialisation, as over gRPC."""
    return forward_pb2.ForwardBatch.FromString(batch_to_proto(b).SerializeToString())


def scheduler_batches() -> list[ForwardBatch]:
    """Every batch of a workload that exercises admissions, chunking, MIXED, prefix hits, logprobs."""
    s = make_scheduler(chunked_prefill_size=8, enable_mixed=True, max_prefill_ratio=0.5)
    shared = list(range(10, 22))
    add(s, "b", [40, 41, 42], temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=2**64 - 1,
        repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=-0.25, logprobs=3, max_new_tokens=8)
    a = add(s, "a", shared + [30, 31], max_new_tokens=6)
    batches: list[ForwardBatch] = []
    added_c = False
    for _ in range(100):
        if a.output_ids and not added_c:
            add(s, "c", shared + [50], max_new_tokens=3)  # a prefix-cache hit on "a"'s pages
            added_c = True
        step = s.schedule()
        if step is None:
            break
        batches.append(step.batch)
        result = result_from_proto(result_to_proto(fake_result(step.batch, 3), step.batch.step))
        s.process_result(step, result)
    return batches


@pytest.fixture(scope="module")
def batches() -> list[ForwardBatch]:
    return scheduler_batches()


def split_batches() -> list[ForwardBatch]:
    """A long prompt arriving while another decodes runs as SPLIT_PREFILL slices; a second one is
    aborted between two of its slices (the next batch releases its slot)."""
    s = make_scheduler(enable_split_prefill=True, split_prefill_min_tokens=10, split_prefill_token_budget=20)
    add(s, "d", [40, 41, 42], max_new_tokens=30)
    first = s.schedule()
    assert first is not None
    s.process_result(first, fake_result(first.batch, None))
    batches: list[ForwardBatch] = [first.batch]
    for rid, start in (("long", 10), ("aborted", 50)):
        add(s, rid, list(range(start, start + 20)))
        for _ in range(100):
            step = s.schedule()
            assert step is not None
            batches.append(step.batch)
            s.process_result(step, fake_result(step.batch, None))
            if step.batch.split_layers is not None and step.batch.split_layers.end == 2 and rid == "aborted":
                assert s.abort(rid) is not None
                break
            if step.batch.split_layers is not None and step.batch.split_layers.end == LIMITS.num_layers:
                break
    batches.append(s.schedule().batch)  # type: ignore[union-attr]
    return batches


def test_split_prefill_batches_round_trip() -> None:
    batches = split_batches()
    layers = [b.split_layers for b in batches if b.forward_mode == ForwardMode.SPLIT_PREFILL]
    assert layers == [(0, 1), (1, 2), (2, 3), (3, 4), (0, 1), (1, 2)]  # 20 tokens, budget 20: a layer a slice
    assert batches[-1].released_slots and batches[-1].forward_mode == ForwardMode.DECODE
    for b in batches:
        assert_same_batch(batch_from_proto(wire(b), LIMITS), b)


def test_scheduler_batches_round_trip(batches: list[ForwardBatch]) -> None:
    modes = {b.forward_mode for b in batches}
    assert {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED} <= modes
    assert any(b.slot_updates for b in batches) and sum(len(b.admissions) for b in batches) >= 3
    assert any(not b.sample_mask.all() for b in batches)  # a non-final prefill chunk
    for b in batches + [ForwardBatch.idle(step=9)]:
        got = batch_from_proto(wire(b), LIMITS)
        assert_same_batch(got, b)


def test_decoded_arrays_are_zero_copy_views(batches: list[ForwardBatch]) -> None:
    m = wire(batches[0])
    got = batch_from_proto(m, LIMITS)
    assert got.sample_mask.dtype == np.bool_
    for name in PER_REQUEST + PER_TOKEN:
        arr = getattr(got, name)
        assert not arr.flags.writeable and not arr.flags.owndata, name


def test_overlap_placeholder_and_known_unsupported_mode_convert(batches: list[ForwardBatch]) -> None:
    decode = next(b for b in batches if b.forward_mode == ForwardMode.DECODE)
    m = wire(decode)
    ids = np.frombuffer(m.input_ids, dtype="<i8").copy()
    ids[:] = -1
    m.input_ids = ids.tobytes()
    m.forward_mode = forward_pb2.FORWARD_MODE_DRAFT_EXTEND
    got = batch_from_proto(m, LIMITS)
    assert got.forward_mode == ForwardMode.DRAFT_EXTEND and got.input_ids.tolist() == [-1] * decode.num_tokens


def test_admission_sampling_maps_to_slot_sampling(batches: list[ForwardBatch]) -> None:
    m = wire(batches[0])
    by_slot = {a.req_pool_idx: a for a in m.admissions}
    wire_b = next(a for a in m.admissions if a.sampling.logprobs == 3)
    assert wire_b.seed == 2**64 - 1 and wire_b.sampling.top_k == 5
    assert all(a.sampling.logprobs == -1 for a in by_slot.values() if a is not wire_b)
    got = batch_from_proto(m, LIMITS)
    assert sorted(a.sampling.logprobs or 0 for a in got.admissions) == [0, 3]
    assert [a.sampling.logprobs for a in got.admissions].count(None) == 1


# ---- malformed batches ---------------------------------------------------------------------------
def i64(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def arr(m: forward_pb2.ForwardBatch, name: str) -> list[int]:
    return np.frombuffer(getattr(m, name), dtype="<i8").tolist()


def with_value(name: str, index: int, value: int) -> Callable[[forward_pb2.ForwardBatch], None]:
    def mutate(m: forward_pb2.ForwardBatch) -> None:
        values = arr(m, name)
        values[index] = value
        setattr(m, name, i64(values))
    return mutate


def dropping_last(name: str) -> Callable[[forward_pb2.ForwardBatch], None]:
    def mutate(m: forward_pb2.ForwardBatch) -> None:
        setattr(m, name, getattr(m, name)[:-8] if name != "sample_mask" else m.sample_mask[:-1])
    return mutate


def set_attr(path: str, value: object) -> Callable[[forward_pb2.ForwardBatch], None]:
    def mutate(m: forward_pb2.ForwardBatch) -> None:
        *parents, leaf = path.split(".")
        obj: object = m
        for p in parents:
            obj = obj[int(p)] if p.isdigit() else getattr(obj, p)  # type: ignore[index]
        setattr(obj, leaf, value)
    return mutate


def clear_sampling(m: forward_pb2.ForwardBatch) -> None:
    m.admissions[0].ClearField("sampling")


MALFORMED: dict[str, tuple[Callable[[forward_pb2.ForwardBatch], None], str]] = {
    "mode_unspecified": (set_attr("forward_mode", 0), "forward_mode"),
    "mode_unknown": (set_attr("forward_mode", 42), "forward_mode"),
    "ragged_bytes": (lambda m: setattr(m, "input_ids", m.input_ids + b"\x00"), "input_ids"),
    "ragged_bytes_per_request": (lambda m: setattr(m, "prefix_lens", m.prefix_lens[:-3]), "prefix_lens"),
    "per_request_lengths": (dropping_last("extend_lens"), "extend_lens"),
    "sample_mask_length": (dropping_last("sample_mask"), "sample_mask"),
    "sample_mask_not_bool": (lambda m: setattr(m, "sample_mask", b"\x02" + m.sample_mask[1:]), "sample_mask"),
    "input_ids_length": (dropping_last("input_ids"), "input_ids"),
    "positions_length": (dropping_last("positions"), "positions"),
    "out_cache_loc_length": (dropping_last("out_cache_loc"), "out_cache_loc"),
    "negative_extend_len": (with_value("extend_lens", 0, -1), "extend_lens"),
    "slot_too_big": (with_value("req_pool_indices", 0, MAX_REQS), "req_pool_indices"),
    "slot_negative": (with_value("req_pool_indices", 0, -1), "req_pool_indices"),
    "slot_twice": (lambda m: with_value("req_pool_indices", 1, arr(m, "req_pool_indices")[0])(m), "req_pool_indices"),
    "seq_beyond_context": (with_value("prefix_lens", 0, MAX_CONTEXT - 1), "prefix_lens"),
    "prefix_negative": (with_value("prefix_lens", 0, -4), "prefix_lens"),
    "positions_inconsistent": (with_value("positions", 1, 5), "positions"),
    "kv_slot_too_big": (with_value("out_cache_loc", 0, NUM_PAGES * PAGE), "out_cache_loc"),
    "kv_slot_negative": (with_value("out_cache_loc", 2, -3), "out_cache_loc"),
    "input_id_beyond_vocab": (with_value("input_ids", 0, VOCAB), "input_ids"),
    "input_id_below_placeholder": (with_value("input_ids", 0, -2), "input_ids"),
    "admission_slot": (set_attr("admissions.0.req_pool_idx", MAX_REQS), "admissions[0].req_pool_idx"),
    "admission_prompt_len": (set_attr("admissions.0.prompt_len", -1), "admissions[0].prompt_len"),
    "admission_sampling_missing": (clear_sampling, "admissions[0].sampling"),
    "admission_top_p": (set_attr("admissions.0.sampling.top_p", 0.0), "top_p"),
    "admission_temperature_nan": (set_attr("admissions.0.sampling.temperature", math.nan), "temperature"),
    "admission_logprobs": (set_attr("admissions.0.sampling.logprobs", -2), "logprobs"),
    "layers_outside_split": (set_attr("split_layer_end", 2), "split_layer_begin/end"),
    "released_slot": (set_attr("released_slots", i64([MAX_REQS])), "released_slots"),
}


@pytest.mark.parametrize(("begin", "end"), [(0, 0), (2, 1), (3, 5), (-1, 2)])
def test_split_prefill_layer_range_within_the_model(begin: int, end: int) -> None:
    m = wire(next(b for b in split_batches() if b.forward_mode == ForwardMode.SPLIT_PREFILL))
    batch_from_proto(m, LIMITS)
    m.split_layer_begin, m.split_layer_end = begin, end
    with pytest.raises(ValueError, match=r"SPLIT_PREFILL: layers \[.*\) are not a range within \[0, 4\)"):
        batch_from_proto(m, LIMITS)

SLOT_UPDATE_MALFORMED: dict[str, tuple[Callable[[forward_pb2.ForwardBatch], None], str]] = {
    "update_slot": (set_attr("slot_updates.0.req_pool_idx", -1), "slot_updates[0].req_pool_idx"),
    "update_start": (set_attr("slot_updates.0.start", MAX_CONTEXT - 2), "slot_updates[0]"),
    "update_kv_loc": (set_attr("slot_updates.0.kv_locs", i64([4, NUM_PAGES * PAGE])), "slot_updates[0].kv_locs"),
    "update_ragged_bytes": (set_attr("slot_updates.0.kv_locs", b"\x01\x02"), "slot_updates[0].kv_locs"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_batch_names_the_field(batches: list[ForwardBatch], case: str) -> None:
    first = batches[0]  # EXTEND of two requests with admissions
    assert first.batch_size >= 2 and first.admissions
    m = wire(first)
    batch_from_proto(m, LIMITS)  # valid before the mutation
    mutate, field = MALFORMED[case]
    mutate(m)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        batch_from_proto(m, LIMITS)


@pytest.mark.parametrize("case", sorted(SLOT_UPDATE_MALFORMED))
def test_malformed_slot_update_names_the_field(batches: list[ForwardBatch], case: str) -> None:
    m = wire(next(b for b in batches if b.slot_updates))
    batch_from_proto(m, LIMITS)
    mutate, field = SLOT_UPDATE_MALFORMED[case]
    mutate(m)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        batch_from_proto(m, LIMITS)


def test_sampling_row_without_tokens_is_rejected() -> None:
    z = np.zeros(1, dtype=np.int64)
    b = ForwardBatch(ForwardMode.DECODE, z, z, z, np.ones(1, dtype=bool), z[:0], z[:0], z[:0])
    with pytest.raises(ValueError, match="sample_mask"):
        batch_from_proto(batch_to_proto(b), LIMITS)


# ---- results -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket", [None, 0, 8])
@pytest.mark.parametrize("top_n", [None, 0, 3])
@pytest.mark.parametrize("num_samples", [0, 4])
def test_result_round_trip(top_n: int | None, num_samples: int, bucket: int | None) -> None:
    b = ForwardBatch(ForwardMode.DECODE, *([np.zeros(num_samples, dtype=np.int64)] * 3),
                     np.ones(num_samples, dtype=bool), *([np.zeros(num_samples, dtype=np.int64)] * 3), step=5)
    r = dataclasses.replace(fake_result(b, top_n), forward_seconds=0.25, cuda_graph_bucket=bucket)
    m = forward_pb2.ForwardResult.FromString(result_to_proto(r, 5).SerializeToString())
    assert m.step == 5 and m.forward_seconds == 0.25
    got = result_from_proto(m)
    assert got.cuda_graph_bucket == bucket and got.forward_seconds == 0.25
    np.testing.assert_array_equal(got.next_token_ids, r.next_token_ids)
    if top_n is None or num_samples == 0:
        assert got.logprobs is None and got.top_logprob_ids is None
        return
    for name in ("logprobs", "top_logprob_ids", "top_logprob_values"):
        g, w = getattr(got, name), getattr(r, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("field", ["next_token_ids", "logprobs", "top_logprob_ids", "top_logprob_values"])
def test_malformed_result_names_the_field(field: str) -> None:
    z = np.zeros(2, dtype=np.int64)
    b = ForwardBatch(ForwardMode.DECODE, z, z, z, np.ones(2, dtype=bool), z, z, z)
    m = result_to_proto(fake_result(b, 2), 1)
    setattr(m, field, getattr(m, field)[:-4] if field != "next_token_ids" else getattr(m, field)[:-3])
    with pytest.raises(ValueError, match=field):
        result_from_proto(m)
