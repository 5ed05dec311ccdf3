#!/usr/bin/env bash
# Download the wheels that the lent GPU machine lacks into .whl/ (git-ignored), for
# tools/gpu_check.sh to install there: that machine reaches no package index.
#
#     bash tools/gpu_wheels.sh        # here, on the CPU machine, once per session with a GPU
#
# Its python3 (3.12, x86-64 Linux, a CUDA build of torch) holds every dependency of gradlane but
# pyzmq. pyzmq's manylinux wheels bundle libzmq and need nothing else on CPython; this script
# checks the wheel's Requires-Dist to keep that true. The version is the one installed in the
# project's venv (what the tests here run against), else what pip resolves from pyproject's
# requirement; PYZMQ_VERSION overrides it. One pyzmq wheel is kept: two would stop the install.
# The device run then carries it: run(command="bash tools/gpu_check.sh", carry=[".whl"], ...).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -n "${PYTHON:-}" ]]; then
    :
elif [[ -x .venv/bin/python ]]; then
    PYTHON=.venv/bin/python
else
    PYTHON=python3
fi

# pyproject's requirement, e.g. "pyzmq>=25", and the version to pin.
SPEC="$(grep -o '"pyzmq[^";]*' pyproject.toml | head -n 1 | tr -d '"')"
VERSION="${PYZMQ_VERSION:-$("$PYTHON" -c 'import zmq; print(zmq.__version__)' 2>/dev/null || true)}"
REQ="${SPEC:-pyzmq}"
[[ -n "$VERSION" ]] && REQ="pyzmq==$VERSION"
echo "gpu_wheels: $REQ (pyproject: ${SPEC:-none}) for CPython 3.12 manylinux x86-64, via $PYTHON"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$TMP" "$REQ"

WHEEL="$(find "$TMP" -maxdepth 1 -name 'pyzmq-*.whl' | head -n 1)"
[[ -n "$WHEEL" ]] || { echo "gpu_wheels: pip saved no pyzmq wheel" >&2; exit 1; }

# Every requirement the wheel declares must be off on CPython 3.12 Linux (pyzmq needs cffi on
# PyPy only); otherwise it would need another wheel carried beside it.
"$PYTHON" - "$WHEEL" <<'EOF'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

target = {"implementation_name": "cpython", "platform_python_implementation": "CPython",
          "python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "extra": ""}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
needs = [Requirement(line.split(":", 1)[1].strip()) for line in lines
         if line.startswith("Requires-Dist:")]
live = [str(r) for r in needs if r.marker is None or r.marker.evaluate(target)]
print("gpu_wheels: Requires-Dist:", ", ".join(str(r) for r in needs) or "none",
      "| needed there:", ", ".join(live) or "nothing")
sys.exit(1 if live else 0)
EOF

mkdir -p .whl
rm -f .whl/pyzmq-*.whl
mv "$WHEEL" .whl/
echo "gpu_wheels: $(ls .whl/pyzmq-*.whl) ($(du -h .whl/pyzmq-*.whl | cut -f1))"
