"""Mutual TLS for the gRPC links (router -> worker: KV events, load; decode -> prefill: KV
transfer). Torch-free: the router uses it too.

KV pages are user data, so a deployment can require both ends of every gRPC link to show a
certificate signed by its CA. The files are PEM; in Kubernetes they come from a Secret
mounted as files (`tls.crt`, `tls.key`, `ca.crt`, the layout cert-manager writes).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    cert: Path  # this process's certificate chain
    key: Path  # its private key
    ca: Path  # the CA that signs every peer

    @classmethod
    def from_dir(cls, directory: str | Path) -> TLSFiles:
        """A mounted Kubernetes TLS Secret: tls.crt, tls.key, ca.crt."""
        d = Path(directory)
        return cls(d / "tls.crt", d / "tls.key", d / "ca.crt")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read TLS files: {exc}") from exc

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with our certificate; require and verify the client's."""
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Connect with our certificate; verify the server's against the CA."""
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)


def add_tls_arg(p: argparse.ArgumentParser) -> None:
    """`--grpc-tls-dir`, shared by `tandem worker` and `tandem router`."""
    p.add_argument("--grpc-tls-dir", default=None,
                   help="mutual TLS on the gRPC links: a directory with tls.crt, tls.key, "
                        "ca.crt (a mounted Kubernetes TLS Secret)")


def tls_from_args(directory: str | None) -> TLSFiles | None:
    """The `--grpc-tls-dir` files, read once now so a bad directory stops start-up with
    the flag named (SystemExit), not at the first connection."""
    if not directory:
        return None
    tls = TLSFiles.from_dir(directory)
    try:
        tls.server_credentials()
    except ValueError as exc:
        raise SystemExit(f"--grpc-tls-dir: {exc}") from exc
    return tls
