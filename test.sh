#!/usr/bin/env bash
# Run every gpuhealth test (unit, promtool, real Prometheus/Alertmanager/Slurm on loopback).
# Extra arguments go to pytest, e.g. ./test.sh tests/exporter -k kmsg
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
