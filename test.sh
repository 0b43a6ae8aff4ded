#!/usr/bin/env bash
# Run every gpuhealth check: ruff and mypy (scripts/typecheck.sh) first, so that a lint or type error
# fails in seconds, then every test (unit, promtool, real Prometheus/Alertmanager/Slurm on loopback).
# Tests run on two workers, one test file per worker at a time (so a module's daemons start once).
# Extra arguments go to pytest, e.g. ./test.sh tests/exporter -k kmsg, or -n 0 for one process.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
.venv/bin/ruff check --quiet .
scripts/typecheck.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
