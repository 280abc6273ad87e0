"""The worker server shared by every role (prefill, decode, both): OpenAI-compatible HTTP,
Prometheus metrics with vLLM's names, and (later) the gRPC control service."""
