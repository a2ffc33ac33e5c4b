#!/usr/bin/env bash
# Creates (once) the project's virtualenv at .venv with moetron installed editable and its
# test extras; later calls return at once unless setup.py changed. Prints the venv's python.
#   MOETRON_PYTHON=/path/python   use that interpreter instead (nothing installed)
#   MOETRON_VENV=dir              venv location (default: <repo>/.venv)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${MOETRON_PYTHON:-}" ]; then echo "$MOETRON_PYTHON"; exit 0; fi
venv="${MOETRON_VENV:-$root/.venv}"
stamp="$venv/.moetron-setup"
want="$(cat "$root/setup.py" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then echo "$venv/bin/python"; exit 0; fi

log() { echo "[setup] $*" >&2; }
fail() {
  log "could not install $1 into $venv: is a package index reachable from here? Without one, point"
  log "MOETRON_PYTHON at an interpreter that already has torch>=2.11 and moetron's dependencies (e.g."
  log "MOETRON_PYTHON=\$(command -v python3), after pip install --no-deps -e $root), or set pip's --find-links."
  exit 1
}
base_python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  log "creating virtualenv $venv"
  "$base_python" -m venv "$venv" >&2
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
  # Without a GPU take the CPU build (this machine keeps a 2.13.0 CPU wheel on disk); with one,
  # let pip pick the default CUDA build.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "installing torch (CUDA build)"; "$py" -m pip install -q "torch>=2.11" >&2 || fail torch
  else
    log "installing torch 2.13.0 (CPU build)"
    "$py" -m pip install -q torch==2.13.0 >&2 || "$py" -m pip install -q "torch>=2.11" >&2 || fail torch
  fi
fi
log "installing moetron (editable) and test extras"
"$py" -m pip install -q -e "$root[test]" >&2 || fail "moetron and its test extras"
echo "$want" > "$stamp"
log "ready: $py"
echo "$py"
