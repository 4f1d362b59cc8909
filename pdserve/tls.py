"""TLS settings of a process and the gRPC credentials made from them.

One ``TLSConfig`` per process: its own certificate and key (PEM files) and, for mutual TLS inside
the cluster, the cluster CA that every peer's certificate must chain to. The gateway's public port
uses the certificate alone (clients have no cluster certificate); the gateway's Registry port,
the workers' ports and every channel between cluster processes use all three (see
docs/architecture.md, "Security").
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

# The metadata key a worker's Register/Heartbeat carries the cluster token in.
TOKEN_METADATA_KEY = "pdserve-cluster-token"


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the TLS {what} {path}: {e.strerror}") from None


@dataclass(frozen=True)
class TLSConfig:
    """``cert``/``key``: this process's certificate chain and private key (PEM paths), given
    together; ``ca``: the cluster CA (PEM path) that peers' certificates must chain to (mutual
    TLS); ``server_name``: the name peers' certificates are checked against instead of the host
    dialed (workers registered by IP address, as in containers)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.ca is not None and self.cert is None:
            raise ValueError(
                "--tls-ca (mutual TLS) needs this process's own certificate: add --tls-cert and "
                "--tls-key"
            )

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        return self.ca is not None


def server_credentials(tls: TLSConfig, require_client_cert: bool) -> grpc.ServerCredentials:
    """Serve with ``tls``'s certificate; with ``require_client_cert``, the handshake fails for a
    client without a certificate issued by ``tls.ca``."""
    pair = (_read(tls.key, "key"), _read(tls.cert, "certificate"))
    if not require_client_cert:
        return grpc.ssl_server_credentials([pair])
    if not tls.mutual:
        raise ValueError("client certificates can only be required with --tls-ca")
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read(tls.ca, "CA"), require_client_auth=True
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """Dial a cluster peer: check its certificate against ``tls.ca``, present ours."""
    if not tls.mutual:
        raise ValueError("dialing a cluster peer over TLS needs --tls-ca")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca, "CA"),
        private_key=_read(tls.key, "key"),
        certificate_chain=_read(tls.cert, "certificate"),
    )


def channel_options(tls: TLSConfig | None) -> list[tuple[str, str]]:
    if tls is not None and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison (the time taken says nothing about how much of it matched)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
