"""TLS for both listeners: the files are checked once at start (one clear line if one is
missing, unreadable, not PEM, or the key does not match the certificate), then handed to
gRPC (ssl_server_credentials) and to Envoy (a DownstreamTlsContext, gateway/envoy.py).

With a client CA (--tls-client-ca) both listeners require a client certificate it signed.
Envoy reaches the gRPC server over a unix socket in the frontend's private (0700)
directory, not over TCP: a loopback port without TLS would let any local user around the
client-certificate check.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from .startup import StartupError


@dataclass(frozen=True)
class TlsFiles:
    cert: str = ""  # PEM certificate chain, the server's first; "" = TLS off
    key: str = ""  # its PEM private key (unencrypted)
    client_ca: str = ""  # PEM CA bundle for client certificates; "" = no client certificate asked

    def __bool__(self) -> bool:
        return bool(self.cert or self.key or self.client_ca)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise StartupError(f"cannot read {flag} {path}: {exc.strerror}") from None


def check(tls: TlsFiles) -> None:
    """Load the files as the listeners will, so that a bad one stops the start here, in one line."""
    if not (tls.cert and tls.key):
        given = " and ".join(
            f for f, v in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-client-ca", tls.client_ca)) if v
        )
        raise StartupError(f"TLS needs both --tls-cert and --tls-key (given: {given})")
    expected = {
        "--tls-cert": b"-----BEGIN CERTIFICATE-----",
        "--tls-key": b"PRIVATE KEY-----",
        "--tls-client-ca": b"-----BEGIN CERTIFICATE-----",
    }
    for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-client-ca", tls.client_ca)):
        text = _read(path, flag) if path else b""
        if path and expected[flag] not in text:
            raise StartupError(
                f"{flag} {path} holds no PEM {'private key' if flag == '--tls-key' else 'certificate'} "
                f"(expected a '{expected[flag].decode().strip('-')}' block)"
            )
        if flag == "--tls-key" and b"ENCRYPTED" in text:
            raise StartupError(
                f"--tls-key {path} is encrypted: give the key without a passphrase (and readable by this user only)"
            )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as exc:
        why = (
            "the key does not match the certificate"
            if "KEY_VALUES_MISMATCH" in str(exc)
            else f"they do not load as a certificate chain and its private key ({exc.reason or exc})"
        )
        raise StartupError(f"--tls-cert {tls.cert} / --tls-key {tls.key}: {why}") from None
    if tls.client_ca:
        try:
            context.load_verify_locations(cafile=tls.client_ca)
        except ssl.SSLError as exc:
            raise StartupError(
                f"--tls-client-ca {tls.client_ca}: no CA certificate in it ({exc.reason or exc})"
            ) from None


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    check(tls)
    client_ca = _read(tls.client_ca, "--tls-client-ca") if tls.client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(tls.key, "--tls-key"), _read(tls.cert, "--tls-cert"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
