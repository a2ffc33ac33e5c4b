#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs the whole suite (GPU tests skip without CUDA)
# in MOETRON_TEST_WORKERS pytest-xdist processes (default 2, CI's cores; a module's tests stay in one
# process; 0 runs them in this one; a later -n in the arguments wins).
#   bash tools/run_tests.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/tools/setup_env.sh")"
cd "$root"
workers="${MOETRON_TEST_WORKERS:-2}"
if [ "$workers" != "0" ] && "$py" -c "import xdist" 2>/dev/null; then
  exec "$py" -m pytest tests -n "$workers" --dist loadfile "$@"
fi
exec "$py" -m pytest tests "$@"
