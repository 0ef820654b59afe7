#!/usr/bin/env bash
# Set up .venv if needed, then run the default test suite (slow tests excluded).
# scripts/test.sh --slow   also runs the tests marked slow; other arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
args=()
for arg in "$@"; do
  if [ "$arg" = "--slow" ]; then args+=(-m "slow or not slow"); else args+=("$arg"); fi
done
exec "$root/.venv/bin/python" -m pytest -q --durations=10 tests "${args[@]}"
