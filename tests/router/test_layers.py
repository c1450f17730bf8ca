"""The router's import contract, read from the source with ``ast`` (nothing is imported).

Layers, top to bottom (a module may import its own layer's helpers and any layer below it,
never one above)::

    entry      router.app, router.cli, router.cli_client, router.__main__, router (package)
    dialects   router.dialects.*  (request in, events out)  |  router.operator.* (admin, status page)
    serving    router.serving.*   (the request record, admission's door, generation)
    workers    router.workers.*   (the state machine, liveness, placement, the worker connection)
    base       router.config (its readers, its presets), router.gguf_meta (a GGUF file's header),
               router.cli_args, router.metrics, router.http.* (usable by all)
    protocol   protocol.*          (the wire; imports neither side)

Further rules: the dialect modules (one per API) import no other dialect module — what two
share lives in ``router.dialects.shared`` (or a helper module, or lower); a dialect helper
imports no dialect module; the dialects and the operator pages never reach past the serving
layer into ``router.workers.pool`` / ``router.workers.process`` / ``router.workers.connection``
(the pool and the worker connection); the dialects import nothing of ``router.workers`` at all, and
no serving-layer name that is the workers' own (:data:`WORKER_NAMES`): a model is a
``router.serving.models.ServedModel`` to them (mypy holds them to its members), a generation a
``router.serving.server.Generation``; nothing in the router imports numpy, gguf or the ``worker`` package.

An edge that breaks a rule and could not be removed yet is listed in :data:`DEBT` with the
reason: the test fails for an unlisted edge, and also for a listed one that is gone (so the
list only shrinks).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ENTRY = {"router", "router.app", "router.cli", "router.cli_client", "router.__main__"}
BASE = {"router.config", "router.gguf_meta", "router.config_readers", "router.config_presets", "router.config_cluster", "router.cli_args", "router.metrics"}

#: One module per API dialect (the others in router.dialects are their shared helpers).
DIALECT_MODULES = {
    "router.dialects.openai_api", "router.dialects.openai_responses", "router.dialects.anthropic_api",
    "router.dialects.ollama_api", "router.dialects.llamacpp_api", "router.dialects.llamacpp_router",
    "router.dialects.decode_api", "router.dialects.openapi",
}

#: What the dialects and the operator pages may not import: the pool and the worker connection.
PAST_THE_DOOR = {"router.workers.pool", "router.workers.process", "router.workers.connection"}

#: Names a dialect module never imports, from anywhere: the workers' own types, and the serving
#: layer's step from a ServedModel back to the slot (``router.serving.models.slot_of``).
WORKER_NAMES = {"ModelSlot", "SlotFacts", "PresetSlot", "Pool", "ReplicaSet", "WorkerProcess", "slot_of",
                "server_of", "ModelServer", "RequestRecord"}

#: Edges that break a rule today, each with why it is still here. (importer, imported).
DEBT: dict[tuple[str, str], str] = {
}


def _layer(mod: str) -> int:
    """The layer's rank (higher imports lower); -1: not the router's."""
    if mod in ENTRY:
        return 5
    if mod.startswith(("router.dialects.", "router.operator.")) or mod in ("router.dialects", "router.operator"):
        return 4
    if mod.startswith("router.serving"):
        return 3
    if mod.startswith("router.workers"):
        return 2
    if mod in BASE or mod.startswith("router.http"):
        return 1
    if mod == "protocol" or mod.startswith("protocol."):
        return 0
    return -1


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports too), resolved
    to module names (``from router.workers import placement`` is ``router.workers.placement``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if _is_module(sub) else mod)
    return out


def router_edges() -> dict[str, set[str]]:
    return {_module_name(p): imports_of(p) for p in sorted((ROOT / "router").rglob("*.py"))}


def violations() -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    for mod, deps in router_edges().items():
        me = _layer(mod)
        for dep in deps:
            top = dep.split(".")[0]
            if top in ("numpy", "gguf", "worker"):
                found[(mod, dep)] = f"the router never imports {top}"
                continue
            them = _layer(dep)
            if them < 0:
                continue
            if them > me:
                found[(mod, dep)] = "imports upward"
            elif mod.startswith("router.dialects.") and dep in DIALECT_MODULES and dep != mod:
                who = "a dialect module" if mod in DIALECT_MODULES else "a dialect helper"
                found[(mod, dep)] = f"{who} imports a dialect module"
            elif mod.startswith("router.dialects") and dep.startswith("router.workers"):
                found[(mod, dep)] = "a dialect reaches into the workers (its model is a ServedModel)"
            elif me == 4 and dep in PAST_THE_DOOR:
                found[(mod, dep)] = "reaches past the serving layer's door"
    return found


def test_the_router_keeps_its_layers() -> None:
    found = violations()
    new = {e: why for e, why in found.items() if e not in DEBT}
    assert not new, "import edges that break the layers:\n" + "\n".join(
        f"  {a} -> {b}: {why}" for (a, b), why in sorted(new.items()))


def test_every_listed_debt_still_exists() -> None:
    gone = sorted(set(DEBT) - set(violations()))
    assert not gone, f"paid debt still listed in DEBT (remove it): {gone}"


def names_imported(path: Path) -> set[str]:
    """Every name ``path`` imports with ``from ... import NAME`` (at any depth of its code)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}


def test_the_dialects_see_a_model_as_the_serving_layer_shows_it() -> None:
    bad = {f"{_module_name(p)} imports {name}"
           for p in sorted((ROOT / "router" / "dialects").rglob("*.py"))
           for name in names_imported(p) & WORKER_NAMES}
    assert not bad, "dialect modules reaching past router.serving.models.ServedModel:\n  " + "\n  ".join(sorted(bad))


def test_protocol_imports_neither_side() -> None:
    for p in sorted((ROOT / "protocol").rglob("*.py")):
        for dep in imports_of(p):
            assert dep.split(".")[0] not in ("router", "worker"), f"{_module_name(p)} imports {dep}"


def test_the_reader_sees_lazy_and_package_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function and a module imported from its package count."""
    assert "router.workers.placement" in imports_of(ROOT / "router" / "workers" / "pool.py")  # ``from router.workers import placement``
    assert "router.http.stream_sessions" in imports_of(ROOT / "router" / "http" / "sse.py")  # imported inside a function
    assert _layer("router.dialects.openai_api") > _layer("router.serving.server") > _layer("router.workers.pool")
