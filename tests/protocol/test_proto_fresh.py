"""The committed gRPC modules are exactly what scripts/gen_proto.sh generates now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py")


def test_generated_grpc_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "src"),
                    f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", str(ROOT / "src/tandem/protocol/worker.proto")],
                   check=True, capture_output=True, text=True)
    for name in GENERATED:
        fresh = (tmp_path / "tandem" / "protocol" / name).read_text()
        committed = (ROOT / "src" / "tandem" / "protocol" / name).read_text()
        assert fresh == committed, f"{name} is stale: run scripts/gen_proto.sh"
