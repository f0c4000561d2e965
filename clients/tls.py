"""TLS credentials for the clients from PEM files (or their bytes).

    from encoderd.clients import EncoderClient, tls_credentials
    client = EncoderClient("encoderd.example:50051", credentials=tls_credentials(
        root_certs="ca.pem", cert_chain="client.pem", private_key="client.key"))   # mutual TLS

root_certs: the CA that signed the server's certificate (None: the system's roots).
cert_chain / private_key: this client's certificate and key, for a server started
with --tls-client-ca; give both or neither.
"""

from __future__ import annotations

import os

import grpc

Pem = str | os.PathLike | bytes | None


def _pem(source: Pem) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    with open(source, "rb") as file:
        return file.read()


def tls_credentials(root_certs: Pem = None, cert_chain: Pem = None, private_key: Pem = None) -> grpc.ChannelCredentials:
    """grpc.ssl_channel_credentials from file paths or PEM bytes."""
    if (cert_chain is None) != (private_key is None):
        raise ValueError("a client certificate needs both cert_chain and private_key")
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(root_certs), private_key=_pem(private_key), certificate_chain=_pem(cert_chain)
    )
