#!/usr/bin/env bash
# What a real NVIDIA node answers and what gpuhealth-exporter costs there, in under 6 minutes.
#
#   OUT=dir bash bench/device_check.sh            # from the repository root, on a GPU node
#   OUT=dir BACKEND=sim bash bench/device_check.sh  # the same path against the simulator
#
# Read-only: NVML queries only; nothing resets, reconfigures or clocks the GPUs. Writes to $OUT:
#   nvml_calls.json         every NVML call the exporter makes, once per GPU: result or error, latency
#   device/<profile>.json   the same, named for the simulator profile it refines (commit it under
#                           tests/exporter/fixtures/device/)
#   summary.json            200 timed scrapes (p50/p99), CPU and RSS over 60 s, sanity problems
#   scrape.prom             one full scrape;  exporter.log  the exporter's log
#   validate.json           gpuhealth-validate's verdict on the node (validate.log, validate.exit);
#                           informative only: a busy or recently faulted node may fail it
# Exit status: 0 when every check passed, 1 when a sanity check failed, 2 when the run itself failed.
set -euo pipefail

: "${OUT:?set OUT to the directory for the results}"
BACKEND="${BACKEND:-nvml}"
WINDOW="${WINDOW:-60}"
SCRAPES="${SCRAPES:-200}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# A usable virtualenv: the repository's own if it has the package, else a fresh one (needs PyPI).
PYTHON=.venv/bin/python
if ! { [ -x "$PYTHON" ] && "$PYTHON" -c 'import gpuhealth.exporter, psutil, pynvml' 2>/dev/null; }; then
  python3 -m venv "$OUT/venv"
  PYTHON="$OUT/venv/bin/python"
  "$PYTHON" -m pip install -q .
fi
EXPORTER="$(dirname "$PYTHON")/gpuhealth-exporter"

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >"$OUT/nvidia-smi.txt" 2>&1 || true

timeout 60 "$PYTHON" bench/device_check.py calls --backend "$BACKEND" --out "$OUT"
# without DCGM's diagnostic or a site command: NVML and kernel-log reads only
timeout 120 "$(dirname "$PYTHON")/gpuhealth-validate" --backend "$BACKEND" >"$OUT/validate.json" \
  2>"$OUT/validate.log" && echo 0 >"$OUT/validate.exit" || echo "$?" >"$OUT/validate.exit"

PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$EXPORTER" --backend "$BACKEND" --listen "127.0.0.1:$PORT" --no-kmsg >"$OUT/exporter.log" 2>&1 &
PID=$!
trap 'kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true' EXIT
for _ in $(seq 60); do
  curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
  kill -0 "$PID" 2>/dev/null || { echo "device_check: the exporter exited; see $OUT/exporter.log" >&2; exit 2; }
  sleep 1
done
sleep 3  # a few sampling runs, so that window features are filled

timeout $((WINDOW + 120)) "$PYTHON" bench/device_check.py scrape --url "http://127.0.0.1:$PORT/metrics" \
  --pid "$PID" --scrapes "$SCRAPES" --window "$WINDOW" --out "$OUT"
