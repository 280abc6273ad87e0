"""Test PKI: a CA made at test time, certificates it issues, and directories laid out like a
mounted Kubernetes TLS Secret - including kubelet's atomic update (`..data` symlink swap).

Shared by tests/kvtransfer/test_tls.py and tests/protocol/test_tls_identity.py.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

import pytest

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

LOCAL_SANS = ("localhost", "127.0.0.1")  # what a certificate for a dialed address carries


class CA:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self.key, hashes.SHA256()))

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, sans: tuple[str, ...] = LOCAL_SANS) -> tuple[bytes, bytes]:
        """(certificate, key) PEM with common name `name`, valid as server and client for
        the subject alternative names `sans` (IP addresses, URIs or DNS names)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([_san(s) for s in sans]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self.key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    def files(self, name: str, sans: tuple[str, ...] = LOCAL_SANS) -> dict[str, bytes]:
        """A TLS Secret's data: tls.crt, tls.key, ca.crt."""
        cert, key = self.issue(name, sans)
        return {"tls.crt": cert, "tls.key": key, "ca.crt": self.pem}

    def secret_dir(self, path: Path, name: str, sans: tuple[str, ...] = LOCAL_SANS) -> Path:
        """A plain directory laid out like a mounted Kubernetes TLS Secret."""
        path.mkdir(parents=True)
        for file, data in self.files(name, sans).items():
            (path / file).write_bytes(data)
        return path


def _san(value: str) -> x509.GeneralName:
    if "://" in value:  # a URI SAN, e.g. a SPIFFE id
        return x509.UniformResourceIdentifier(value)
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        return x509.DNSName(value)


class SecretVolume:
    """A directory updated as kubelet updates a Secret volume: each version is written into
    a fresh `..<n>` directory, then the `..data` symlink is swapped to it atomically
    (rename), and the visible files are symlinks through `..data`."""

    def __init__(self, path: Path, data: dict[str, bytes]) -> None:
        self.path = path
        self.version = 0
        path.mkdir(parents=True)
        self.update(data)
        for name in data:
            (path / name).symlink_to(f"..data/{name}")

    def update(self, data: dict[str, bytes]) -> None:
        self.version += 1
        version = self.path / f"..v{self.version}"
        version.mkdir()
        for name, content in data.items():
            (version / name).write_bytes(content)
        tmp = self.path / "..data_tmp"
        tmp.symlink_to(version.name)
        os.replace(tmp, self.path / "..data")
