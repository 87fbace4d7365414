#!/usr/bin/env bash
# make bench-gpu on a lent GPU machine, in one call: its image's Python, torch and Lightning, and for the rest the
# packages `make device-kit` packed into .gpu-kit/ (the device tool's run with carry [".gpu-kit"]). The JSON, the table and the log go to
# $OUT (or results/ where it is unset), the JSON after every section, so that a run cut short still brings back
# what it measured. Arguments go to bench/gpu.py (--cpu: its short CPU run, to check the kit on a machine without a
# GPU against an environment of the image's versions: PYTHON=... bench/device/bench-gpu.sh --cpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-results}
SITE=${SITE:-/tmp/rasterscale-site}
mkdir -p "$OUT"
KIT=.gpu-kit/site-cp312.tar.xz
test -f "$KIT" || { echo "bench-gpu.sh: no $KIT: run make device-kit, and carry .gpu-kit"; exit 2; }
rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf "$KIT"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" bench/device/environment.py | tee "$OUT/environment.txt"
"$PYTHON" bench/gpu.py --out "$OUT/bench-gpu.json" --throughput "$OUT/throughput.json" "$@" 2>&1 | tee "$OUT/bench-gpu.log"
