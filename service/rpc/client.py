"""A small Python client for ``modeserve.v1.Generate``, and the ``modeserve client`` command."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import grpc

from ...proto.v1 import generate_pb2, generate_pb2_grpc


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_messages: int = 0


# A stream the server refused before it began (HTTP/2 REFUSED_STREAM: a connection over its
# MAX_CONCURRENT_STREAMS, which a client can overrun while the server still counts closing streams)
# ends UNAVAILABLE before any response; gRPC retries such a call (only until a response has arrived).
RETRY_SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": "modeserve.v1.Generate"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.02s", "maxBackoff": "0.5s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"]}}]})


class GenerateClient:
    def __init__(self, target: str, api_key: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        """``api_key``: sent as ``authorization: Bearer KEY``; ``credentials``: TLS (plaintext without)."""
        options = [("grpc.enable_retries", 1), ("grpc.service_config", RETRY_SERVICE_CONFIG)]
        self.channel = (grpc.secure_channel(target, credentials, options=options) if credentials is not None
                        else grpc.insecure_channel(target, options=options))
        self.stub = generate_pb2_grpc.GenerateStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def stream(self, text: str = "", token_ids: Sequence[int] = (), chat: bool = False,
               timeout: float | None = None, request_id: str = "",
               **sampling: Any) -> Iterator[generate_pb2.GenerateResponse]:
        req = generate_pb2.GenerateRequest(request_id=request_id, text=text, token_ids=list(token_ids), chat=chat,
                                           sampling=generate_pb2.SamplingParams(**sampling))
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)  # type: ignore[no-any-return]

    def generate(self, text: str = "", token_ids: Sequence[int] = (), chat: bool = False,
                 timeout: float | None = None, **sampling: Any) -> Completion:
        out = Completion()
        for msg in self.stream(text, token_ids, chat, timeout, **sampling):
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            out.num_messages += 1
            if msg.finish_reason:
                out.finish_reason = msg.finish_reason
                out.prompt_tokens = msg.usage.prompt_tokens
                out.completion_tokens = msg.usage.completion_tokens
        return out

    def tokenize(self, text: str, chat: bool = False) -> list[int]:
        return list(self.stub.Tokenize(generate_pb2.TokenizeRequest(text=text, chat=chat),
                                       metadata=self.metadata).token_ids)

    def model_info(self) -> generate_pb2.ModelInfoResponse:
        return self.stub.ModelInfo(generate_pb2.ModelInfoRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("client", help="send one prompt to a Generate server, stream")
    p.add_argument("prompt")
    p.add_argument("--server", default="localhost:50051")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--api-key", default=None, help="the server's API key (sent as authorization: Bearer KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM CA of the server's certificate: connect over TLS")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .tls import TlsFiles, channel_credentials

    credentials = channel_credentials(TlsFiles(ca=args.tls_ca)) if args.tls_ca else None
    client = GenerateClient(args.server, api_key=args.api_key, credentials=credentials)
    try:
        for msg in client.stream(args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except grpc.RpcError as exc:
        print(f"modeserve client: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0
