#!/usr/bin/env bash
# Set up .venv if needed, then train the default experiment (4 learners x 2 fake CPU devices on the
# bundled corpus). Extra arguments pass through: scripts/train.sh --config.num_steps=50
# Another experiment: scripts/train.sh --config=experiments/dp_baseline_cpu.py
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
config_args=(--config=experiments/tiny_cpu.py)
for arg in "$@"; do
  case "$arg" in --config=*|--config) config_args=() ;; esac
done
exec "$root/.venv/bin/python" -m decoupled_diloco.main "${config_args[@]}" "$@"
