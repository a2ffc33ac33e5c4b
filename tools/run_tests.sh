#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs the suite (GPU tests skip without CUDA) in
# MOETRON_TEST_WORKERS pytest-xdist processes (default 2, CI's cores; a module's tests stay in one
# process). One process instead with MOETRON_TEST_WORKERS=0, or when the arguments ask for the
# debugger or uncaptured output (--pdb, --trace, -s, --capture=no, -p no:xdist); a -n of your own wins.
#   bash tools/run_tests.sh [pytest args...]            # the whole suite (tests/)
#   bash tools/run_tests.sh tests/core/test_mx.py -x    # given paths: only those
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/tools/setup_env.sh")"
cd "$root"
workers="${MOETRON_TEST_WORKERS:-2}"
targets=(tests)
for a in "$@"; do
  case "$a" in
    --pdb|--trace|-s|--capture=no|no:xdist) workers=0 ;;
  esac
  if [ "${a#-}" = "$a" ] && [ -e "${a%%::*}" ]; then targets=(); fi  # a path of the user's own
done
if [ "$workers" != "0" ] && "$py" -c "import xdist" 2>/dev/null; then
  exec "$py" -m pytest ${targets[@]+"${targets[@]}"} -n "$workers" --dist loadfile "$@"
fi
exec "$py" -m pytest ${targets[@]+"${targets[@]}"} "$@"
