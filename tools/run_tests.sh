#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs the suite (GPU tests skip without CUDA) in
# MOETRON_TEST_WORKERS pytest-xdist processes (default 2, CI's cores; a module's tests stay in one
# process), each with OMP_NUM_THREADS = cores / workers unless it is set. One process instead with
# MOETRON_TEST_WORKERS=0, or when the arguments ask for the debugger or uncaptured output (--pdb,
# --trace, -s, --capture=no, -p no:xdist); a -n of your own wins.
#   bash tools/run_tests.sh [pytest args...]            # the whole suite (tests/)
#   bash tools/run_tests.sh tests/core/test_mx.py -x    # given paths: only those
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/tools/setup_env.sh")"
cd "$root"
# Compiled bytecode is cached (__pycache__, git-ignored) even where PYTHONDONTWRITEBYTECODE is set:
# each of the suite's few hundred processes would otherwise compile moetron's sources again
unset PYTHONDONTWRITEBYTECODE
workers="${MOETRON_TEST_WORKERS:-2}"
targets=(tests)
for a in "$@"; do
  case "$a" in
    --pdb|--trace|-s|--capture=no|no:xdist) workers=0 ;;
  esac
  if [ "${a#-}" = "$a" ] && [ -e "${a%%::*}" ]; then targets=(); fi  # a path of the user's own
done
if [ "$workers" != "0" ] && "$py" -c "import xdist" 2>/dev/null; then
  # Each worker's torch gets its share of the cores (OMP_NUM_THREADS, unless set): two workers of two
  # OpenMP threads each on CI's two cores spin-wait on each other (measured: a 4-file subset 130 -> 56 s)
  if [ -z "${OMP_NUM_THREADS:-}" ]; then
    cores="$(nproc 2>/dev/null || echo 2)"
    export OMP_NUM_THREADS=$(( cores / workers > 0 ? cores / workers : 1 ))
  fi
  # --no-loadscope-reorder: modules in collection order, the slow ones first (tests/conftest.py), not
  # xdist's most-tests-first, which left the few-test, long modules for one worker at the end
  exec "$py" -m pytest ${targets[@]+"${targets[@]}"} -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
exec "$py" -m pytest ${targets[@]+"${targets[@]}"} "$@"
