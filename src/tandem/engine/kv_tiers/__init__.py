"""Host-memory and disk tiers for KV blocks the device pool evicts (`store.TierStore`), their
record format (`codec`), and the tiers themselves (`host`, `disk`). The offload connector
(`engine/kv_connector/offload.py`) saves into them and loads from them."""
