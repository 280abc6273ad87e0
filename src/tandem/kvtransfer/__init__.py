"""KV-page transfer between prefill and decode workers.

`pages` (format, validation), `base` (backend interface + registry), `grpc_backend`,
`torch_backend`, `shm_backend` (+ `shm_segments`), `service` (prefill side: the KVTransfer
gRPC service, leases), `client` (decode side: `RemotePrefill`). Importing the package
registers the built-in backends.
"""

from tandem.kvtransfer import (  # noqa: F401 - register themselves
    grpc_backend,
    shm_backend,
    torch_backend,
)
from tandem.kvtransfer.base import BACKENDS, TransferBackend, make_backend, register_backend
from tandem.kvtransfer.pages import KVTransferError, PageLayout

__all__ = ["BACKENDS", "KVTransferError", "PageLayout", "TransferBackend", "make_backend",
           "register_backend"]
