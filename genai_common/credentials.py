"""Credentials read from files, for both planes (docs/design.md, "Processes and planes").

TLS certificates and keys (PEM) for the servers and the data-plane client,
and secrets kept one per file (a bearer token mounted from a Kubernetes
Secret). Only start-up code calls these: a missing or unreadable file is an
``OSError`` and an empty secret a ``ValueError``, both configuration errors.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

# The shortest secret that keys a MAC (the KV integrity secret): 256 bits.
MIN_SECRET_BYTES = 32


def read_secret_file(path: str, what: str) -> str:
    """The contents of ``path`` with surrounding whitespace stripped; ``what``
    names the flag in the error when the file holds nothing else."""
    secret = Path(path).read_text().strip()
    if not secret:
        raise ValueError(f"{what}: {path} is empty")
    return secret


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> grpc.ServerCredentials:
    """TLS for a server; with ``client_ca_file``, clients must present a
    certificate signed by it (mTLS). The files are checked first: gRPC itself
    reports a key that does not match its certificate, or a file that is not
    PEM, only as "Failed to bind to address"."""
    check_key_pair(cert_file, key_file, "tls_cert_file", "tls_key_file")
    if client_ca_file:
        check_ca_file(client_ca_file, "tls_client_ca_file")
    client_ca = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(key_file).read_bytes(), Path(cert_file).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def channel_credentials(
    ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """TLS for a client that trusts ``ca_file``; ``cert_file``/``key_file``
    (together) are its own certificate, for a server that requires mTLS."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    check_ca_file(ca_file, "tls_ca_file")
    if cert_file and key_file:
        check_key_pair(cert_file, key_file, "tls_cert_file", "tls_key_file")
    return grpc.ssl_channel_credentials(
        Path(ca_file).read_bytes(),
        Path(key_file).read_bytes() if key_file else None,
        Path(cert_file).read_bytes() if cert_file else None,
    )


def check_key_pair(cert_file: str, key_file: str, cert_name: str, key_name: str) -> None:
    """``ValueError`` naming both files unless ``key_file`` is the PEM private
    key of the PEM certificate (chain) in ``cert_file``; ``OSError`` if either
    cannot be read."""
    Path(cert_file).read_bytes(), Path(key_file).read_bytes()  # unreadable: OSError
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ValueError(
                f"{key_name} {key_file} is not the private key of the certificate in "
                f"{cert_name} {cert_file} (KEY_VALUES_MISMATCH)"
            ) from None
        raise ValueError(
            f"{cert_name} {cert_file} / {key_name} {key_file}: not a PEM certificate and "
            f"its private key ({reason})"
        ) from None


def check_ca_file(ca_file: str, name: str) -> None:
    """``ValueError`` unless ``ca_file`` holds PEM CA certificates."""
    Path(ca_file).read_bytes()  # unreadable: OSError
    try:
        ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError as exc:
        raise ValueError(f"{name} {ca_file}: not a PEM certificate ({exc.reason or exc})") from None
