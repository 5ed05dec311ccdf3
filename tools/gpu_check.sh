#!/usr/bin/env bash
# Check gradlane's CUDA path on a machine with one CUDA GPU, in one command: the GPU tests
# (tests/gpu) and the DDP step benchmark on the GPU, in under 6 minutes.
#
#     bash tools/gpu_check.sh [OUTDIR]     # OUTDIR: $OUT if set, else ./gpu_check_out
#
# Writes OUTDIR/gpu_check.json (environment, stages and their times, per-test outcomes, the
# benchmark's summary, the verdict) and OUTDIR/gpu_check.log (all output), and prints the
# verdict last. Exit 0 on PASS, 1 on FAIL. Without a CUDA GPU: one line, nothing written, exit 0.
#
# On a lent GPU machine (no package index there, no pyzmq): first, here, `bash tools/gpu_wheels.sh`
# (the pyzmq wheel into .whl/), then the device call
#     run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=420)
#
# It runs under `python3` on PATH, the one with the CUDA build of torch (GPU_CHECK_PYTHON
# overrides it). The logic, its time budget and the details: tools/gpu_check.py.
set -euo pipefail

PYTHON="${GPU_CHECK_PYTHON:-python3}"
exec "$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/gpu_check.py" "$@"
