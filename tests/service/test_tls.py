"""TLS with certificates made here (``trustme``): an engine with mutual TLS refuses a client without a
certificate its CA signed and serves a router with one; the router serves Generate and the HTTP API
over TLS (plaintext clients fail), and Admin on its own port with mutual TLS; certificates rotated
while a stream runs: it finishes, new connections get the new certificate; plaintext health ports for
probes; the drain hook over mutual TLS."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, NamedTuple

import grpc
import pytest
import trustme

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.builder import build_engine
from modeserve.service.router.app import HttpAddress, RouterApp
from modeserve.service.router.remote import RemoteRouterConfig, start_remote_router
from modeserve.service.rpc.client import GenerateClient
from modeserve.service.rpc.engine_client import describe_engine, engine_healthy
from modeserve.service.rpc.engine_server import EngineServer, create_engine_server
from modeserve.service.rpc.tls import TlsFiles, channel_credentials
from tests.service.http_fixtures import tiny_model_with_tokenizer

pytestmark = pytest.mark.slow


class Pki(NamedTuple):
    ca: trustme.CA
    ca_file: str
    server: TlsFiles  # 127.0.0.1 / localhost, for every server here
    client: TlsFiles  # the router's client certificate, and the CA to verify servers with


def pki(folder: Path, name: str) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    ca_file = str(folder / "ca.pem")
    ca.cert_pem.write_to_path(ca_file)
    files = {}
    for role, names in (("server", ("127.0.0.1", "localhost")), ("client", (f"{name}-router",))):
        cert = ca.issue_cert(*names)
        cert.private_key_pem.write_to_path(str(folder / f"{role}.key"))
        cert.cert_chain_pems[0].write_to_path(str(folder / f"{role}.pem"))
        files[role] = TlsFiles(str(folder / f"{role}.pem"), str(folder / f"{role}.key"), ca_file)
    return Pki(ca, ca_file, files["server"], files["client"])


class Cluster(NamedTuple):
    model: Path
    pki: Pki
    engine: EngineServer
    engine_address: str
    router: RouterApp
    http_base: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("tls")
    model = tiny_model_with_tokenizer(root / "model")
    keys = pki(root / "pki", "a")
    parts = build_engine(str(model), page_size=4, kv_cache_tokens=4096)
    engine = create_engine_server(parts.runner, "127.0.0.1:0", model_path=str(model),
                                  eos_token_ids=parts.eos_token_ids, tls=keys.server)
    address = f"127.0.0.1:{engine.port}"
    # the router's own servers use a copy of the server files: the rotation test replaces them
    own = root / "router"
    own.mkdir()
    for f in ("server.pem", "server.key"):
        (own / f).write_bytes((root / "pki" / f).read_bytes())
    router_tls = TlsFiles(str(own / "server.pem"), str(own / "server.key"))
    router = start_remote_router("127.0.0.1:0", [address], str(model),
                                 RemoteRouterConfig(http=HttpAddress("127.0.0.1", 0), tls=router_tls,
                                                    engine_tls=keys.client, wait=30))
    assert router.http is not None
    yield Cluster(model, keys, engine, address, router, f"https://127.0.0.1:{router.http.port}")
    router.stop(grace=1)
    engine.stop(grace=1)


def test_engine_with_mutual_tls_refuses_clients_without_its_certificate(cluster: Cluster, tmp_path: Path) -> None:
    addr = cluster.engine_address
    assert not engine_healthy(addr)  # plaintext
    assert not engine_healthy(addr, tls=TlsFiles(ca=cluster.pki.ca_file))  # TLS, no client certificate
    stranger = pki(tmp_path / "other", "b")  # a certificate another CA signed
    assert not engine_healthy(addr, tls=TlsFiles(stranger.client.cert, stranger.client.key, cluster.pki.ca_file))
    assert engine_healthy(addr, tls=cluster.pki.client)
    channel, desc = describe_engine(addr, 10, cluster.pki.client)
    channel.close()
    assert desc.vocab_size > 0


def test_router_serves_generate_over_tls_and_refuses_plaintext(cluster: Cluster) -> None:
    target = f"127.0.0.1:{cluster.router.port}"
    client = GenerateClient(target, credentials=channel_credentials(TlsFiles(ca=cluster.pki.ca_file)))
    try:
        got = client.generate(token_ids=[5, 6, 7], max_new_tokens=8, ignore_eos=True, temperature=0.0)
    finally:
        client.close()
    ref = LLM(model=str(cluster.model), page_size=16).generate(
        prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=8,
                                                                      ignore_eos=True))[0]
    assert got.token_ids == ref.token_ids
    plain = GenerateClient(target)
    try:
        with pytest.raises(grpc.RpcError) as err:
            plain.generate(token_ids=[5, 6], max_new_tokens=2, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        plain.close()
    cli = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "client", "hello", "--server", target,
                          "--no-chat", "--max-new-tokens", "2", "--tls-ca", cluster.pki.ca_file],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr


def https(base: str, path: str, ca_file: str, body: object = None) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30, context=ssl.create_default_context(cafile=ca_file)) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_http_api_over_tls(cluster: Cluster) -> None:
    out = https(cluster.http_base, "/v1/completions", cluster.pki.ca_file,
                {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 3  # type: ignore[index]
    with pytest.raises(OSError):  # plaintext HTTP to the TLS port
        urllib.request.urlopen(cluster.http_base.replace("https", "http") + "/health", timeout=5).read()
    curl = subprocess.run(["curl", "-sS", "--cacert", cluster.pki.ca_file, f"{cluster.http_base}/health"],
                          capture_output=True, text=True, timeout=60)
    assert json.loads(curl.stdout) == {"status": "ok"}, curl.stderr


def test_rotated_certificates_keep_streams_and_serve_new_connections(cluster: Cluster, tmp_path: Path) -> None:
    target = f"127.0.0.1:{cluster.router.port}"
    old = GenerateClient(target, credentials=channel_credentials(TlsFiles(ca=cluster.pki.ca_file)))
    try:
        stream = old.stream(token_ids=[5, 6, 7], max_new_tokens=200, ignore_eos=True)
        got = list(next(stream).token_ids)
        new_pki = pki(tmp_path / "new", "a")  # a new CA and a new server certificate
        own = Path(cluster.router.http.server.config.ssl_certfile).parent  # type: ignore[union-attr,arg-type]
        for f in ("server.pem", "server.key"):
            tmp = own / f"{f}.tmp"
            tmp.write_bytes((tmp_path / "new" / f).read_bytes())
            os.replace(tmp, own / f)  # atomically, as a Secret volume swaps its files
        for msg in stream:
            got += msg.token_ids
        assert len(got) == 200  # the stream that was open finished on its connection
    finally:
        old.close()
    fresh = GenerateClient(target, credentials=channel_credentials(TlsFiles(ca=new_pki.ca_file)))
    try:
        assert fresh.generate(token_ids=[5, 6], max_new_tokens=2, ignore_eos=True).completion_tokens == 2
    finally:
        fresh.close()
    stale = GenerateClient(target, credentials=channel_credentials(TlsFiles(ca=cluster.pki.ca_file)))
    try:
        with pytest.raises(grpc.RpcError):  # trusts only the old CA
            stale.generate(token_ids=[5, 6], max_new_tokens=2, timeout=5)
    finally:
        stale.close()
    deadline = time.monotonic() + 10  # the HTTP server checks its files every second
    while True:
        try:
            assert https(cluster.http_base, "/health", new_pki.ca_file) == {"status": "ok"}
            break
        except (ssl.SSLError, urllib.error.URLError) as exc:  # urllib wraps a failed handshake in URLError
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if not isinstance(reason, ssl.SSLError) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_tls_files_are_checked() -> None:
    with pytest.raises(ValueError, match="together"):
        TlsFiles(cert="/etc/hostname")
    with pytest.raises(ValueError, match="not a file"):
        TlsFiles(ca="/no/such/ca.pem")


def test_health_port_answers_probes_in_plaintext_while_the_server_speaks_tls(tmp_path: Path) -> None:
    """``--health-port``: the kubelet's gRPC probe speaks no TLS; a TLS server's health states (the same
    ones, readiness changes included) are also served in plaintext on a port of their own, and nothing
    else is served there."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from modeserve.service.rpc.grpc_server import EventLoopThread, GrpcServer, ServerOptions
    from modeserve.service.rpc.tls import ReloadingServerCredentials

    keys = pki(tmp_path, "h")
    loop = EventLoopThread()
    server = GrpcServer(loop, "127.0.0.1:0", [], ["modeserve.v1.Engine"],
                        credentials=ReloadingServerCredentials(keys.server, require_client_cert=True).credentials,
                        options=ServerOptions(health_port=0))
    try:
        health_port = server.health_port
        assert health_port is not None and health_port not in (0, server.port)
        Status = health_pb2.HealthCheckResponse

        def check(port: int, service: str) -> int:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=5).status

        assert check(health_port, "") == check(health_port, "modeserve.v1.Engine") == Status.SERVING
        with pytest.raises(grpc.RpcError):  # the main port: TLS only
            check(server.port, "")
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            with pytest.raises(grpc.RpcError) as err:  # only health on the probe port
                channel.unary_unary("/modeserve.v1.Engine/Describe")(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        loop.run(server.set_not_serving("modeserve.v1.Engine"))  # draining: readiness fails, liveness holds
        assert check(health_port, "modeserve.v1.Engine") == Status.NOT_SERVING
        assert check(health_port, "") == Status.SERVING
    finally:
        server.shutdown(grace=0)
        loop.close()
    with pytest.raises(ValueError, match="health-port"):
        ServerOptions(health_port=70000)


def test_admin_port_serves_only_clients_with_a_certificate_the_ca_signed(cluster: Cluster) -> None:
    """``router --admin-port`` with a CA: Admin (SetRanks decides where prompts go) moves to a port
    of its own with mutual TLS (the operator presents its certificate; a client without one fails the
    handshake), Generate stays on the main port for clients without certificates, and Admin is not
    served there any more."""
    from modeserve.operator.router_client import GrpcAdminClient, RouterUnreachable

    keys = cluster.pki
    router = start_remote_router("127.0.0.1:0", [cluster.engine_address], str(cluster.model), RemoteRouterConfig(
        tls=TlsFiles(keys.server.cert, keys.server.key, keys.ca_file), engine_tls=keys.client, wait=30,
        admin_port=0))
    try:
        assert router.admin is not None and router.admin.port != router.port
        admin = f"127.0.0.1:{router.admin.port}"
        assert GrpcAdminClient(5, keys.client).get_ranks(admin, tls=True) == {0: "READY"}
        with pytest.raises(RouterUnreachable, match="UNAVAILABLE"):  # no client certificate: no handshake
            GrpcAdminClient(5, TlsFiles(ca=keys.ca_file)).get_ranks(admin, tls=True)
        main = f"127.0.0.1:{router.port}"
        with pytest.raises(RouterUnreachable, match="UNIMPLEMENTED"):
            GrpcAdminClient(5, keys.client).get_ranks(main, tls=True)
        client = GenerateClient(main, credentials=channel_credentials(TlsFiles(ca=keys.ca_file)))
        try:
            assert client.generate(token_ids=[5, 6, 7], max_new_tokens=3, ignore_eos=True).completion_tokens == 3
        finally:
            client.close()
    finally:
        router.stop(grace=1)


def test_drain_reaches_an_engine_with_mutual_tls(cluster: Cluster) -> None:
    """The engine pod's preStop ``modeserve drain`` with the pod's certificate: the engine answers
    (the router's stream is still open, so not drained within a second). Last in this module: the
    engine drains."""
    from modeserve.service.cli.drain import drain

    assert drain(cluster.engine_address, 1.0, cluster.pki.client) is False
