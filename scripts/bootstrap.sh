#!/usr/bin/env bash
# Install what gpuhealth needs on a Debian machine: Debian packages for the real daemons (when root,
# through apt-get; otherwise one message naming what is missing) and a Python venv in .venv.
# Sourced by demo.sh and test.sh; safe to run again (it only installs what is missing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

# binary -> Debian package
declare -A NEEDED=(
  [prometheus]=prometheus
  [promtool]=prometheus
  [prometheus-alertmanager]=prometheus-alertmanager
  [amtool]=prometheus-alertmanager
  [prometheus-node-exporter]=prometheus-node-exporter
  [slurmctld]=slurmctld
  [slurmd]=slurmd
  [scontrol]=slurm-client
  [munged]=munge
  [chromium]=chromium
  [systemd-analyze]=systemd
  [pg_ctlcluster]=postgresql   # the webhook's shared journal (initdb, postgres under /usr/lib/postgresql)
  [victoria-metrics]=victoria-metrics
  [vmalert]=victoria-metrics
)

missing_packages() {
  local bin missing=()
  for bin in "${!NEEDED[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$bin" >/dev/null 2>&1 \
      || missing+=("${NEEDED[$bin]}")
  done
  python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
  command -v python3 >/dev/null 2>&1 || missing+=(python3)
  printf '%s\n' "${missing[@]}" | sort -u | grep -v '^$' || true
}

install_debian_packages() {
  local missing
  missing="$(missing_packages | tr '\n' ' ')"
  [ -z "${missing// }" ] && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "gpuhealth: installing Debian packages: $missing" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    # shellcheck disable=SC2086
    apt-get install -y -q --no-install-recommends $missing >/dev/null
  else
    echo "gpuhealth: missing Debian packages: $missing" >&2
    echo "gpuhealth: install them with: sudo apt-get install --no-install-recommends $missing" >&2
    exit 2
  fi
}

install_venv() {
  local stamp="$VENV/.gpuhealth-installed" want
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  python3 - <<'PY' || { echo "gpuhealth: Python >= 3.11 is required" >&2; exit 2; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
  echo "gpuhealth: creating the Python environment in $VENV" >&2
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools >/dev/null
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]"
  echo "$want" > "$stamp"
}

export PATH="$PATH:/usr/sbin:/sbin"
install_debian_packages
install_venv
