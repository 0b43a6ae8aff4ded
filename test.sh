#!/usr/bin/env bash
# Run every gpuhealth test (unit, promtool, real Prometheus/Alertmanager/Slurm on loopback).
# Runs on two workers, one test file per worker at a time (so a module's daemons start once).
# Extra arguments go to pytest, e.g. ./test.sh tests/exporter -k kmsg, or -n 0 for one process.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
