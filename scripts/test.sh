#!/usr/bin/env bash
# Set up .venv if needed, then run the default test suite (slow tests excluded).
# scripts/test.sh --slow         also runs the tests marked slow;
# scripts/test.sh --under-load   runs it while a CPU burner keeps every core busy, as on a shared CI
#                                machine: no test may depend on the host being idle.
# Other arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
args=()
burn=0
for arg in "$@"; do
  case "$arg" in
    --slow) args+=(-m "slow or not slow") ;;
    --under-load) burn=1 ;;
    *) args+=("$arg") ;;
  esac
done
if [ "$burn" = 0 ]; then
  exec "$root/.venv/bin/python" -m pytest -q --durations=10 tests "${args[@]}"
fi
burners=()
stop_burners() { [ ${#burners[@]} -eq 0 ] || kill "${burners[@]}" 2>/dev/null || true; }
trap stop_burners EXIT
trap 'exit 130' INT TERM
cores=$(nproc)
for _ in $(seq "$cores"); do
  ( trap - INT TERM; while :; do :; done ) &
  burners+=($!)
done
echo "[test] under load: ${#burners[@]} busy loops, one per core, for the length of the run"
"$root/.venv/bin/python" -m pytest -q --durations=10 tests "${args[@]}"
