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
    echo "[setup] installing modelyard and its dependencies into .venv (~1-2 min and ~600 MB on a fresh machine; the full log: .venv/pip-install.log)"
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    # one line per package as pip gets it (pip -q says nothing for a minute or more); on failure, the log's end
    if ! .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev]' > .venv/pip-install.log 2>&1 < /dev/null; then
        tail -n 30 .venv/pip-install.log >&2
        echo "[setup] pip install failed (full log: .venv/pip-install.log)" >&2
        exit 1
    fi &
    PIP_PID=$!
    SHOWN=0
    while kill -0 "$PIP_PID" 2> /dev/null; do
        sleep 5
        N=$(grep -c '^Collecting' .venv/pip-install.log 2> /dev/null || true)
        if [ "${N:-0}" != "$SHOWN" ]; then
            echo "[setup]   $N packages resolved so far (latest: $(grep '^Collecting' .venv/pip-install.log | tail -n 1 | cut -d' ' -f2))"
            SHOWN=$N
        fi
    done
    wait "$PIP_PID"
    grep '^Successfully installed' .venv/pip-install.log | cut -c1-200 | sed 's/^/[setup]   /' || true
    touch "$STAMP"
else
    echo "[setup] .venv is up to date"
fi
.venv/bin/python scripts/fetch_models.py
# The project's own modules compiled to __pycache__/*.pyc (as pip does for an installed wheel): the
# editable install leaves that to the first import, which writes nothing where PYTHONDONTWRITEBYTECODE
# is set, so every router and worker start would compile ~90 ms of source again. Up-to-date files
# are skipped; a .pyc older than its source is ignored by the interpreter (timestamp check).
.venv/bin/python -m compileall -q router protocol worker > /dev/null || echo "[setup] compileall failed (modules compile at import)"
# The quantized path's numba kernels, compiled into numba's disk cache once per checkout, so that no
# model load compiles them (scripts/compile_kernels.py). Checked again after an engine source, the
# install or NUMBA_CACHE_DIR changed (numba then recompiles only what is stale; a current cache takes
# ~2 s to load). MODELYARD_COMPILE_KERNELS=0 skips it. A failure is reported, not fatal.
KSTAMP=.venv/.modelyard-kernels
if [ "${MODELYARD_COMPILE_KERNELS:-1}" != "0" ]; then
    KWANT="numba cache: ${NUMBA_CACHE_DIR:-worker/engine/kernels/__pycache__}"
    if [ ! -f "$KSTAMP" ] || [ "$(cat "$KSTAMP")" != "$KWANT" ] || [ "$STAMP" -nt "$KSTAMP" ] \
            || [ -n "$(find worker/engine -name '*.py' -newer "$KSTAMP")" ]; then
        echo "[setup] quantized path's kernels: compiling what numba's disk cache lacks (the first time in a checkout: ~1 min of one core on an idle machine, 2-3 min on a busy one; progress every 15 s)"
        if .venv/bin/python scripts/compile_kernels.py; then
            echo "$KWANT" > "$KSTAMP"
        fi
    fi
fi
