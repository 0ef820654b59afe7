#!/usr/bin/env bash
# Shared set-up of scripts/train.sh and scripts/test.sh: create .venv if missing and install the
# package (with its test, tpu and pathways extras) into it. Re-installs only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
stamp="$venv/.installed-$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing decoupled-diloco and its dependencies into $venv (first time: a few minutes)"
  "$venv/bin/python" -m pip install -q -e "$root[test,tpu,pathways]"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
