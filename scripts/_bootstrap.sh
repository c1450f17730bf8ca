# Sourced by scripts/serve and scripts/test: create .venv, install, fetch models.
# Idempotent: a second run reinstalls nothing that is already current.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
STAMP=.venv/.modelyard-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "[setup] installing modelyard and its dependencies into .venv"
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
    touch "$STAMP"
else
    echo "[setup] .venv is up to date"
fi
.venv/bin/python scripts/fetch_models.py
