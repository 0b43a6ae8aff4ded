#!/usr/bin/env bash
# Run the gpuhealth demo: the whole stack on simulated GPUs. Extra arguments go to 'gpuhealth demo'.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec .venv/bin/gpuhealth demo "$@"
