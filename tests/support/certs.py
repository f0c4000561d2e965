"""A throwaway PKI for TLS tests, made at test time: a CA, a server certificate for
localhost / 127.0.0.1, a client certificate, and a second CA that signed nothing we trust."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA certificate both sides trust
    server_cert: Path
    server_key: Path
    client_cert: Path  # signed by `ca`, for mutual TLS
    client_key: Path
    other_ca: Path  # an unrelated CA
    other_key: Path  # a key that matches neither certificate

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _certificate(
    subject: str, key, issuer: str, issuer_key, *, ca: bool = False, server: bool = False, client: bool = False
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, other_ca_key, server_key, client_key, stray_key = (
        ec.generate_private_key(ec.SECP256R1()) for _ in range(5)
    )
    return Pki(
        ca=_write_cert(
            _certificate("encoderd test CA", ca_key, "encoderd test CA", ca_key, ca=True), directory / "ca.pem"
        ),
        server_cert=_write_cert(
            _certificate("localhost", server_key, "encoderd test CA", ca_key, server=True), directory / "server.pem"
        ),
        server_key=_write_key(server_key, directory / "server.key"),
        client_cert=_write_cert(
            _certificate("test client", client_key, "encoderd test CA", ca_key, client=True), directory / "client.pem"
        ),
        client_key=_write_key(client_key, directory / "client.key"),
        other_ca=_write_cert(
            _certificate("another CA", other_ca_key, "another CA", other_ca_key, ca=True), directory / "other-ca.pem"
        ),
        other_key=_write_key(stray_key, directory / "other.key"),
    )
