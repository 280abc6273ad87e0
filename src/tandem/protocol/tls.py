"""Mutual TLS for the gRPC links (router -> worker: KV events, load; decode -> prefill: KV
transfer). Torch-free: the router uses it too.

KV pages are user data, so a deployment can require both ends of every gRPC link to show a
certificate signed by its CA. The files are PEM; in Kubernetes they come from a Secret
mounted as files (`tls.crt`, `tls.key`, `ca.crt`, the layout cert-manager writes).
"""

from __future__ import annotations

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
