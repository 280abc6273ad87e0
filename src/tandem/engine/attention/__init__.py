"""Paged-KV paged attention backends (interface + registry)."""
