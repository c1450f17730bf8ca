# Sourced by scripts/test and scripts/typecheck, after _bootstrap.sh: the static type check.
# What mypy checks and how strictly is pyproject.toml's [tool.mypy] (protocol/ and router/ strict,
# worker/ with mypy's defaults); its incremental cache is .mypy_cache/ (~6 s warm, ~40 s cold).
run_typecheck() {
    echo "[typecheck] mypy over ${*:-protocol/, router/ and worker/} (pyproject.toml [tool.mypy])"
    if .venv/bin/python -m mypy "$@"; then
        return 0
    fi
    echo "[typecheck] FAILED: mypy found type errors (listed above); ./scripts/typecheck runs the check alone" >&2
    return 1
}
