"""Prefill-role worker process (arrives with issue [2/5])."""
