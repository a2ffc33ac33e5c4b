#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs the whole suite (GPU tests skip without CUDA).
#   bash tools/run_tests.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/tools/setup_env.sh")"
cd "$root"
exec "$py" -m pytest tests "$@"
