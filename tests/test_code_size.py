"""Size limits of the code (issue 24): no module of router/, worker/ or protocol/ over 500 lines,
no class over 300, no function over 80 — the numba kernels aside (:data:`KERNELS`).

What is over a limit today is listed in :data:`DEBT` with its size now, as a ratchet: an entry may
only shrink, nothing new may join it, and an entry that got within its limit (or no longer
exists) must be removed from it. Entries are keyed by package and file name (``router:pool.py``),
not by folder, so that moving a module between subpackages keeps its entry; a file name that
several modules of one package share is keyed by its path (``worker/engine/arch/__init__.py``).

Sizes are physical lines: a module's lines, a class's or function's from its ``def`` / ``class``
line to its last (decorators not counted), measured with :mod:`ast`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import ROOT

PACKAGES = ("router", "worker", "protocol")
LIMITS = {"module": 500, "class": 300, "function": 80}

#: The numba kernels: long by nature (one explicit SIMD kernel per quantization form), exempt.
KERNELS = frozenset({
    "worker/engine/kernels/quant.py",
    "worker/engine/kernels/quant_kernels.py",
    "worker/engine/kernels/attn_kernels.py",
    "worker/engine/kernels/simd.py",
})

#: DEBT, not a standard: what is over a limit today, at its size today. Shrink these; when one is
#: within its limit, delete its line. Keys: ``"<package>:<file name>"`` for a module,
#: ``"<package>:<file name>::<Class>"`` / ``"...::<Class>.<method>"`` / ``"...::<function>"``.
DEBT: dict[str, int] = {}  # empty since issue 24's splits: keep it so


def measure() -> dict[str, tuple[str, int, str]]:
    """Every module, class and function of PACKAGES (kernels aside): key -> (kind, lines, path)."""
    out: dict[str, tuple[str, int, str]] = {}
    for pkg in PACKAGES:
        paths = [p for p in sorted((ROOT / pkg).rglob("*.py")) if p.relative_to(ROOT).as_posix() not in KERNELS]
        names = [p.name for p in paths]
        for path in paths:
            rel = path.relative_to(ROOT).as_posix()
            src = path.read_text()
            base = f"{pkg}:{path.name}" if names.count(path.name) == 1 else rel
            out[base] = ("module", len(src.splitlines()), rel)

            def walk(node: ast.AST, prefix: str) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        kind = "class" if isinstance(child, ast.ClassDef) else "function"
                        name = prefix + child.name
                        size = (child.end_lineno or child.lineno) - child.lineno + 1
                        out.setdefault(f"{base}::{name}", (kind, size, rel))
                        walk(child, name + ".")
                    else:
                        walk(child, prefix)

            walk(ast.parse(src), "")
    return out


def test_nothing_grows_beyond_the_size_limits() -> None:
    sizes = measure()
    assert len(sizes) > 500, "measured almost nothing: the walk is broken"
    over = {k: v for k, v in sizes.items() if v[1] > LIMITS[v[0]]}
    new = sorted(f"{v[2]}: {k.split('::', 1)[-1] if '::' in k else 'module'} ({v[0]}) has {v[1]} lines, "
                 f"limit {LIMITS[v[0]]}" for k, v in over.items() if k not in DEBT)
    grown = sorted(f"{v[2]}: {k} has {v[1]} lines, more than its recorded {DEBT[k]} (it may only shrink)"
                   for k, v in over.items() if k in DEBT and v[1] > DEBT[k])
    assert not new and not grown, "\n".join(new + grown)


def test_the_debt_list_holds_only_what_is_still_over() -> None:
    sizes = measure()
    stale = sorted(f"{k}: {'gone' if k not in sizes else f'{sizes[k][1]} lines, within its limit'} — "
                   f"delete its DEBT line" for k in DEBT if k not in sizes or sizes[k][1] <= LIMITS[sizes[k][0]])
    assert not stale, "\n".join(stale)


def test_the_kernel_exemption_names_real_files() -> None:
    for rel in KERNELS:
        assert (ROOT / rel).is_file(), rel
