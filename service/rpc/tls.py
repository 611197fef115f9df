"""TLS for every modeserve gRPC server and client, from PEM files (``--tls-cert``, ``--tls-key``,
``--tls-ca``). A server re-reads its files when they change, at the next handshake (streams already
open keep their connection); with a CA it requires client certificates signed by it (mutual TLS).
A client verifies the server against the CA and, given a certificate, presents it."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag}: {path} is not a file")

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None

    def read(self, path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()


def file_stamp(files: TlsFiles) -> tuple[int, ...]:
    """The files' modification times: a change means a new certificate to load."""
    return tuple(os.stat(p).st_mtime_ns for p in (files.cert, files.key, files.ca) if p)


class ReloadingServerCredentials:
    """The server's certificate configuration, replaced when a file's mtime changes (gRPC asks
    before each new connection's handshake)."""

    def __init__(self, files: TlsFiles, require_client_cert: bool) -> None:
        """``require_client_cert``: mutual TLS, client certificates signed by ``files.ca``."""
        if not files.serves_tls:
            raise ValueError("a TLS server needs --tls-cert and --tls-key")
        if require_client_cert and files.ca is None:
            raise ValueError("mutual TLS needs --tls-ca (the CA that signs client certificates)")
        self._files = files
        self._lock = threading.Lock()
        self._stamp = file_stamp(files)
        self._client_ca = files.ca if require_client_cert else None
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._config(), self._fetch, require_client_authentication=require_client_cert)

    def _config(self) -> grpc.ServerCertificateConfiguration:
        f = self._files
        return grpc.ssl_server_certificate_configuration([(f.read(f.key), f.read(f.cert))], f.read(self._client_ca))

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            with self._lock:
                stamp = file_stamp(self._files)
                if stamp == self._stamp:
                    return None
                config = self._config()
                self._stamp = stamp
        except (OSError, ValueError) as exc:  # a file mid-rotation: keep the current one, try again next time
            logger.warning("TLS files unreadable, keeping the current certificate: %s", exc)
            return None
        logger.info("TLS certificate reloaded from %s", self._files.cert)
        return config


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Verify the server against ``files.ca`` (the system roots without one); present
    ``files.cert`` as the client certificate if there is one."""
    return grpc.ssl_channel_credentials(files.read(files.ca), files.read(files.key), files.read(files.cert))


def open_channel(target: str, files: TlsFiles | None, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A plaintext channel without ``files``, else a TLS one."""
    if files is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, channel_credentials(files), options=options)
