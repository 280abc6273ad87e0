"""HTTP front door: KV-cache-aware routing (arrives with issue [3/5])."""
