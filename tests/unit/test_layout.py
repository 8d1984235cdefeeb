"""The house rules the code's layout keeps: the kernels are a leaf (nothing in kernels/ imports the rest of
tfq), no module imports itself back through others, and no module outgrows one idea (400 lines)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LARGEST = 400


def modules() -> dict[str, Path]:
    """Dotted name -> file, for the installed layout (kernels/ is tfq.kernels, examples/ is tfq.examples)."""
    found = {}
    for folder, package in (("tfq", "tfq"), ("kernels", "tfq.kernels")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, at the top or inside functions (a lazy import is still an arrow)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t not in ("tfq",):
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_kernels_import_nothing_from_the_rest_of_tfq():
    bad = [(m, t) for m, targets in graph().items() if m.startswith("tfq.kernels")
           for t in targets if not t.startswith("tfq.kernels")]
    assert bad == []
    for path in (ROOT / "kernels").glob("*.py"):  # and reach each other by relative imports only
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("tfq", "kernels") for n in names), (path.name, names)


def test_no_import_circle_in_the_package():
    g = graph()
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        for nxt in sorted(g[node]):
            if nxt in trail:
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, trail + [nxt])
        done.add(node)

    done: set[str] = set()
    for start in sorted(g):
        if start not in done:
            visit(start, [start])
    assert cycles == []


def test_no_module_outgrows_one_idea():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: s for n, s in sizes.items() if s >= LARGEST} == {}
