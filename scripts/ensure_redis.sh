#!/usr/bin/env bash
# Make sure Debian's `redis-server` binary is installed: the router's rate-limit tests start
# their own instance of it on a free port. Installs it with apt-get when missing (as root, or
# with passwordless sudo); otherwise says what to install.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [[ "$(id -u)" -ne 0 ]]; then
  SUDO="sudo -n"
fi
if command -v apt-get >/dev/null 2>&1; then
  echo "[ensure_redis] installing redis-server with apt-get" >&2
  $SUDO apt-get update -qq || true
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    redis-server >/dev/null || true
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "[ensure_redis] redis-server is missing; install it (Debian/Ubuntu: apt-get install" \
       "redis-server)" >&2
  exit 1
fi
