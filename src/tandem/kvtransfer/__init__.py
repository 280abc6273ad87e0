"""KV-page transfer between prefill and decode workers (arrives with issue [4/5])."""
