"""Mutual TLS for the gRPC links (router -> worker: KV events, load; decode -> prefill: KV
transfer). Torch-free: the router uses it too.

KV pages are user data, so a deployment can require both ends of every gRPC link to show a
certificate signed by its CA. The files are PEM; in Kubernetes they come from a Secret
mounted as files (`tls.crt`, `tls.key`, `ca.crt`, the layout cert-manager writes).

Identity: peers are dialed by pod IP, which no shared certificate can list. With
`--grpc-tls-server-name NAME` every peer's certificate is verified against the DNS SAN NAME
instead (`grpc.ssl_target_name_override`; servers check their clients' SAN too, see
`tls_peers`). An InferenceService's identity is `peer_identity(name, namespace)`.

Renewal: `TLSFiles.current()` re-reads the files (at most every `recheck_s`, comparing
contents; through kubelet's `..data` link so the three come from one version) and keeps the
last pair that passes `TLSMaterial.check`. Server credentials are dynamic (each handshake
asks for the current pair); clients build credentials per channel (`tls_peers.PeerChannel`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import logging
import math
import os
import re
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.protocol import engine_flags as flags

logger = logging.getLogger(__name__)
IDENTITY_DOMAIN = "tandem.internal"
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*")


def peer_identity(name: str, namespace: str) -> str:
    """The certificate identity (a DNS SAN) every router and worker of InferenceService `name`
    in `namespace` shows and expects: `NAME.NS.tandem.internal`. Both must be DNS labels
    (ValueError otherwise)."""
    for what, value in (("name", name), ("namespace", namespace)):
        if not isinstance(value, str) or not _LABEL.fullmatch(value):
            raise ValueError(f"peer identity: {what} {value!r} is not a DNS label "
                             "(lowercase letters, digits and '-', at most 63)")
    return f"{name}.{namespace}.{IDENTITY_DOMAIN}"


@dataclass(frozen=True)
class TLSMaterial:
    """One consistent read of the three PEM files."""

    cert: bytes  # this process's certificate chain
    key: bytes  # its private key
    ca: bytes  # the CA(s) that sign every peer

    @functools.cached_property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for part in (self.cert, self.key, self.ca):
            h.update(len(part).to_bytes(8, "big") + part)
        return h.hexdigest()

    def check(self) -> None:
        """ValueError unless ca.crt holds certificates and tls.key is tls.crt's key (a
        half-written update fails here)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_verify_locations(cadata=self.ca.decode("ascii"))
        except (ssl.SSLError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"ca.crt holds no PEM certificate ({exc})") from exc
        with _mem_file(self.cert) as cert, _mem_file(self.key) as key:
            try:  # a password callback keeps OpenSSL from prompting for an encrypted key
                ctx.load_cert_chain(cert, key, password=lambda: b"\0")
            except ssl.SSLError as exc:
                if exc.reason == "KEY_VALUES_MISMATCH":
                    raise ValueError("tls.key is not the private key of tls.crt") from exc
                raise ValueError(f"tls.crt/tls.key are not a PEM certificate and its "
                                 f"unencrypted private key ({exc.reason or exc})") from exc

    def server_config(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)],
                                                         root_certificates=self.ca)


@contextlib.contextmanager
def _mem_file(data: bytes) -> Iterator[str]:
    """A path OpenSSL can read `data` from: an anonymous memory file (Linux), else a temp
    file readable only by us."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("tandem-tls", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.NamedTemporaryFile() as f:  # mode 0600
        f.write(data)
        f.flush()
        yield f.name


@dataclass(eq=False)
class TLSFiles:
    """The mounted files and what this process does with them. `current()` re-reads them at
    most every `recheck_s` (thread-safe: gRPC's handshakes call it too) and keeps the last
    pair that passed `TLSMaterial.check`."""

    cert: Path  # this process's certificate chain
    key: Path  # its private key
    ca: Path  # the CA that signs every peer
    server_name: str | None = None  # every peer's certificate must carry this DNS SAN
    recheck_s: float = 5.0
    _good: TLSMaterial | None = field(default=None, init=False, repr=False)
    _bad: str | None = field(default=None, init=False, repr=False)  # the problem last logged
    _checked: float = field(default=-math.inf, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def from_dir(cls, directory: str | Path, server_name: str | None = None,
                 recheck_s: float = 5.0) -> TLSFiles:
        """A mounted Kubernetes TLS Secret: tls.crt, tls.key, ca.crt."""
        d = Path(directory)
        return cls(d / "tls.crt", d / "tls.key", d / "ca.crt", server_name, recheck_s)

    def _read(self) -> TLSMaterial:
        try:
            return self._read_once()
        except OSError:  # a version directory can vanish just after a swap: once more
            try:
                return self._read_once()
            except OSError as exc:
                raise ValueError(f"cannot read TLS files: {exc}") from exc

    def _read_once(self) -> TLSMaterial:
        paths = (self.cert, self.key, self.ca)
        data = self.cert.parent / "..data"  # kubelet swaps this link to update the volume
        if len({p.parent for p in paths}) == 1 and data.is_symlink():
            base = data.resolve()  # one version of the three, even mid-swap
            paths = tuple(base / p.name for p in paths)
        return TLSMaterial(*(p.read_bytes() for p in paths))

    def load(self) -> TLSMaterial:
        """Read and check the files now; ValueError if they do not pass."""
        material = self._read()
        material.check()
        with self._lock:
            self._good, self._checked = material, time.monotonic()
        return material

    def current(self) -> TLSMaterial:
        """The material to use now: the files' if they changed and pass, else the last good
        (a warning is logged once per distinct problem)."""
        with self._lock:
            good, now = self._good, time.monotonic()
            if good is not None and now - self._checked < self.recheck_s:
                return good
            self._checked = now
            try:
                material = self._read()
                if good is not None and material.fingerprint == good.fingerprint:
                    return good
                material.check()
            except ValueError as exc:
                if good is None:
                    raise
                if str(exc) != self._bad:
                    self._bad = str(exc)
                    logger.warning("gRPC TLS: %s: keeping the last good certificate: %s",
                                   self.cert.parent, exc)
                return good
            if good is not None:
                logger.info("gRPC TLS: %s changed; new connections use it", self.cert.parent)
            self._good, self._bad = material, None
            return material

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with our certificate; require a client certificate signed by the CA. Each new
        connection's handshake picks up renewed files (`current`)."""
        first = self.current()
        served = [first.fingerprint]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            try:
                material = self.current()
            except Exception:  # noqa: BLE001 - called by gRPC's handshaker: never raise
                logger.exception("gRPC TLS: cannot reload the server certificate")
                return None
            if material.fingerprint == served[0]:
                return None
            served[0] = material.fingerprint
            return material.server_config()

        return grpc.dynamic_ssl_server_credentials(first.server_config(), fetch,
                                                   require_client_authentication=True)

    def channel_credentials(self, material: TLSMaterial | None = None
                            ) -> grpc.ChannelCredentials:
        """Connect with our certificate; verify the server's against the CA."""
        m = material or self.current()
        return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key,
                                            certificate_chain=m.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        """With a server name, the server's certificate is verified against it, not against
        the address dialed (pod IPs are in no certificate)."""
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def add_tls_arg(p: argparse.ArgumentParser) -> None:
    """`--grpc-tls-dir` and `--grpc-tls-server-name`, shared by `tandem worker` and
    `tandem router`."""
    p.add_argument(flags.GRPC_TLS_DIR, default=None,
                   help="mutual TLS on the gRPC links: a directory with tls.crt, tls.key, "
                        "ca.crt (a mounted Kubernetes TLS Secret; re-read when it changes)")
    p.add_argument(flags.GRPC_TLS_SERVER_NAME, default=None, metavar="NAME",
                   help="with --grpc-tls-dir: every gRPC peer's certificate must carry the "
                        "DNS name NAME (e.g. ISVC.NAMESPACE.tandem.internal), whatever "
                        "address it is dialed at; without it a server is verified against "
                        "the address dialed")


def tls_from_args(directory: str | None, server_name: str | None = None) -> TLSFiles | None:
    """The `--grpc-tls-dir` files, read once now so a bad directory stops start-up with
    the flag named (SystemExit), not at the first connection."""
    if server_name is not None and not _HOSTNAME.fullmatch(server_name):
        raise SystemExit(f"--grpc-tls-server-name: {server_name!r} is not a DNS name")
    if not directory:
        if server_name:
            raise SystemExit("--grpc-tls-server-name needs --grpc-tls-dir")
        return None
    tls = TLSFiles.from_dir(directory, server_name or None)
    try:
        tls.load()
    except ValueError as exc:
        raise SystemExit(f"--grpc-tls-dir: {exc}") from exc
    return tls
