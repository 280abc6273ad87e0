#!/usr/bin/env bash
# Regenerate the Python gRPC modules from src/tandem/protocol/*.proto (needs grpcio-tools,
# in the test extra). tests/protocol/test_proto_fresh.py fails when the committed ones are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${1:-src}"
"$PY" -m grpc_tools.protoc -I src --python_out="$OUT" --grpc_python_out="$OUT" \
  --pyi_out="$OUT" src/tandem/protocol/worker.proto
