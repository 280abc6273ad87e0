"""The engine's KV connector seam (`base`: scheduler side, worker side, page API with
leases, registry) and its implementations (`pd`: prefill/decode disaggregation over
`tandem.kvtransfer`)."""

from tandem.engine.kv_connector.base import (
    KV_CONNECTORS,
    ConnectorMetadata,
    ExternalMatch,
    FinishAction,
    KVConnector,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
    LeaseError,
    LeaseStats,
    PageLease,
    make_connector,
    register,
)

__all__ = ["KV_CONNECTORS", "ConnectorMetadata", "ExternalMatch", "FinishAction",
           "KVConnector", "KVConnectorRole", "KVConnectorScheduler", "KVConnectorWorker",
           "LeaseError", "LeaseStats", "PageLease", "make_connector", "register"]
