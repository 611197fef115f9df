"""What the fuzz tests and ``modeserve bench fuzz`` send to the public surfaces (``hypothesis``
strategies): HTTP bodies, ``GenerateRequest``s, and bytes for a gRPC port (no HTTP/2 at all, HTTP/2
frames of any kind, gRPC calls whose message framing or protobuf bytes are garbage). The
``ForwardBatch``es for an engine are ``fuzz_batches``'."""

from __future__ import annotations

import json
from typing import Any, Sequence

from hypothesis import strategies as st

from ...proto.v1 import generate_pb2

# ---- HTTP API -------------------------------------------------------------------------------------
HTTP_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "min_p", "seed", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "stream", "stream_options",
               "echo", "ignore_eos", "repetition_penalty", "frequency_penalty", "presence_penalty", "tokens",
               "return_token_ids", "user"]
HTTP_PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
small_ints = st.integers(-5, 300)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=30) | json_values}), max_size=3)
near_schema = st.fixed_dictionaries({}, optional={
    "messages": messages | json_values, "prompt": st.text(max_size=30) | st.lists(small_ints, max_size=8) | json_values,
    "max_tokens": small_ints | json_values, "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5), "top_k": small_ints, "stop": st.text(max_size=4) | st.lists(st.text(max_size=4)),
    "stream": st.booleans(), "logprobs": st.booleans() | small_ints, "top_logprobs": small_ints,
    "n": small_ints, "seed": st.integers(-10, 2**65), "echo": st.booleans(), "tokens": st.lists(small_ints),
    "stop_token_ids": st.lists(st.integers(-5, 10**6), max_size=3), "model": st.text(max_size=10) | json_values})
any_json = json_values | st.dictionaries(st.sampled_from(HTTP_FIELDS), json_values)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()


# (path, body): near the OpenAI schema, any JSON, or any bytes
http_bodies = (st.tuples(st.sampled_from(HTTP_PATHS), near_schema.map(_json_bytes))
               | st.tuples(st.sampled_from(HTTP_PATHS[:4]), any_json.map(_json_bytes))
               | st.tuples(st.sampled_from(HTTP_PATHS[:4]), st.binary(max_size=200)))

# ---- Generate -------------------------------------------------------------------------------------
sampling = st.builds(
    generate_pb2.SamplingParams, max_new_tokens=st.integers(-2**31, 300), temperature=st.floats(-2, 3, width=32),
    top_p=st.floats(-1, 2, width=32), top_k=st.integers(-2**31, 2**31 - 1), min_p=st.floats(-1, 2, width=32),
    seed=st.integers(0, 2**64 - 1), stop=st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=3), ignore_eos=st.booleans(),
    logprobs=st.integers(-3, 30), repetition_penalty=st.floats(-1, 3, width=32),
    frequency_penalty=st.floats(-3, 3, width=32), presence_penalty=st.floats(-3, 3, width=32))
generate_requests = st.builds(generate_pb2.GenerateRequest, text=st.text(max_size=60),
                              token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=20), chat=st.booleans(),
                              sampling=sampling)

# ---- bytes on a gRPC port -------------------------------------------------------------------------
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(kind: int, flags: int, stream_id: int, payload: bytes, length: int | None = None) -> bytes:
    """One HTTP/2 frame: 24-bit length (``payload``'s unless given), type, flags, 31-bit stream id."""
    size = len(payload) if length is None else length
    return size.to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def _hpack_literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing, no Huffman (names and values under 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def grpc_call_bytes(path: str, messages: Sequence[bytes]) -> bytes:
    """A whole gRPC call as a client's bytes: preface, SETTINGS, HEADERS for ``path``, then ``messages``
    as DATA frames on stream 1 (each one's bytes as they are: a gRPC length prefix or not), the last
    with END_STREAM."""
    headers = b"".join(_hpack_literal(k, v) for k, v in [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
        ("content-type", "application/grpc"), ("te", "trailers")])
    frames = [h2_frame(1, 0x4, 1, headers)]  # END_HEADERS
    frames += [h2_frame(0, 0x1 if i == len(messages) - 1 else 0, 1, data) for i, data in enumerate(messages)]
    return H2_PREFACE + h2_frame(4, 0, 0, b"") + b"".join(frames)


def grpc_message(flag: int, payload: bytes, length: int | None = None) -> bytes:
    """gRPC's length-prefixed message: compressed flag, 32-bit length (``payload``'s unless given)."""
    return bytes([flag]) + (len(payload) if length is None else length).to_bytes(4, "big") + payload


_any_frame = st.builds(h2_frame, st.integers(0, 10) | st.integers(0, 255), st.integers(0, 255),
                       st.integers(0, 7) | st.integers(0, 2**32 - 1), st.binary(max_size=48),
                       st.none() | st.integers(0, 2**24 - 1))
_garbage_message = st.builds(grpc_message, st.integers(0, 1) | st.integers(0, 255), st.binary(max_size=64),
                             st.none() | st.integers(0, 2**32 - 1)) | st.binary(max_size=16)


def raw_streams(paths: Sequence[str]) -> st.SearchStrategy[bytes]:
    """Bytes for a TCP connection to a gRPC port: anything; the preface and then anything; HTTP/2 frames
    of any type, flags, stream and length; a call to one of ``paths`` with garbage message framing."""
    return (st.binary(max_size=300) | st.binary(max_size=64).map(lambda b: H2_PREFACE + b)
            | st.lists(_any_frame, max_size=6).map(lambda fs: H2_PREFACE + h2_frame(4, 0, 0, b"") + b"".join(fs))
            | st.builds(grpc_call_bytes, st.sampled_from(list(paths)), st.lists(_garbage_message, max_size=3)))


# The methods each port serves, by kind of call; never Admin.SetRanks or Engine.Drain, whose every request
# (any bytes with unknown fields parse) is an operator's order, not input to survive
_HEALTH = {"/grpc.health.v1.Health/Check": "unary_unary", "/grpc.health.v1.Health/Watch": "unary_stream",
           "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": "stream_stream"}
ROUTER_METHODS = {"/modeserve.v1.Generate/Generate": "unary_stream", "/modeserve.v1.Generate/Tokenize": "unary_unary",
                  "/modeserve.v1.Generate/ModelInfo": "unary_unary", **_HEALTH}
ENGINE_METHODS = {"/modeserve.v1.Engine/Forward": "stream_stream", "/modeserve.v1.Engine/Describe": "unary_unary",
                  **_HEALTH}


def garbage_calls(methods: dict[str, str]) -> st.SearchStrategy[tuple[str, list[bytes]]]:
    """(method path, request messages): protobuf bytes that may not parse, sent through grpc itself."""
    return st.tuples(st.sampled_from(sorted(methods)), st.lists(st.binary(max_size=64), min_size=1, max_size=3))
