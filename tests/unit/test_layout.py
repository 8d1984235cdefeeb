"""The house rules the code's layout keeps: the layers of docs/architecture.md (an import runs down them, never
up), the kernels a leaf (nothing in kernels/ imports the rest of tfq), no module importing itself back through
others, no module outgrowing one idea (400 lines), and a top level of a few modules beside the groups."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LARGEST = 400
TOP_LEVEL = 8

# docs/architecture.md's layers, the highest first: a module may import its own layer's modules and any below.
# A name stands for itself and every module under it; the longest name that matches decides.
LAYERS = (
    ("tfq", "tfq.__main__", "tfq.cli", "tfq.ray"),  # the commands, and serving them on Ray
    ("tfq.serve", "tfq.bench", "tfq.llm", "tfq.parallel.rank_main"),  # servers, benches, the Python API, a rank's main
    ("tfq.proofs", "tfq.suite", "tfq.receipts"),  # the checks (tfq together, verify, kernels), their chats, receipts
    ("tfq.engine",),  # engine, scheduler, runner, streams, pages, caches, drafting, the layer guard
    ("tfq.decode",),  # sampling, penalties, grammars, tool calls
    ("tfq.plan",),  # keys, layout in bytes
    ("tfq.model.load",),  # builds a model: one process's, or a tensor-parallel group's
    ("tfq.parallel",),  # a model across ranks
    ("tfq.model",),  # config, weights, tokenizer, the forward, the kernel guard
    ("tfq.kernels",),
    ("tfq.errors", "tfq.nearest", "tfq.heap"),  # the one error users see; float32 functions rounded exactly; the heap
)


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
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
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


def layer_of(module: str) -> int:
    matches = [(len(name), i) for i, names in enumerate(LAYERS) for name in names
               if module == name or module.startswith(name + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return max(matches)[1]


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [(m, t) for m, targets in sorted(g.items()) for t in sorted(targets) if layer_of(t) < layer_of(m)]


def test_every_import_runs_down_the_layers():
    assert upward(graph()) == []


def test_control_an_import_up_the_layers_is_found():
    g = graph()
    g["tfq.engine.pages"] = g["tfq.engine.pages"] | {"tfq.serve.app"}
    assert upward(g) == [("tfq.engine.pages", "tfq.serve.app")]


def test_the_top_level_is_a_few_modules_beside_the_groups():
    top = sorted(p.name for p in (ROOT / "tfq").glob("*.py"))
    assert len(top) <= TOP_LEVEL, top


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


# ---------------------------------------------------------------------------------------------- parameters

MOST_PARAMETERS = 10  # past it, parameters that travel together go in a named record (docs/architecture.md)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def parameter_count(f: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    """Every parameter, keyword-only ones too; *args and **kwargs one each; a leading self or cls not."""
    a = f.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    own = positional[:1] in (["self"], ["cls"])
    return len(positional) - own + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def typer_apps(tree: ast.Module) -> set[str]:
    """The names a module binds to typer.Typer(...)."""
    return {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "typer.Typer" for t in node.targets if isinstance(t, ast.Name)}


def exempt(decorator: ast.expr, apps: set[str]) -> bool:
    """@triton.jit (a kernel's parameters are its launch's) and a Typer app's @app.command(...) or
    @app.callback(...) (a command's parameters are its options)."""
    call = isinstance(decorator, ast.Call)
    d = decorator.func if call else decorator
    if not (isinstance(d, ast.Attribute) and isinstance(d.value, ast.Name)):
        return False
    command = call and d.value.id in apps and d.attr in ("command", "callback")
    return (d.value.id, d.attr) == ("triton", "jit") or command


def crowded(source: str, imported_apps: dict[str, set[str]] | None = None) -> list[tuple[str, int, int]]:
    """(name, line, parameters) of each function in `source` over MOST_PARAMETERS, the exempt left out.
    imported_apps: module -> its Typer apps, for the apps `source` imports (tfq.cli.app's `app`)."""
    tree = ast.parse(source)
    apps = typer_apps(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in (imported_apps or {}):
            apps |= {a.asname or a.name for a in node.names if a.name in imported_apps[node.module]}
    return [(getattr(f, "name", "lambda"), f.lineno, parameter_count(f)) for f in ast.walk(tree)
            if isinstance(f, FUNCTIONS) and parameter_count(f) > MOST_PARAMETERS
            and not any(exempt(d, apps) for d in getattr(f, "decorator_list", []))]


def test_no_function_takes_more_than_ten_parameters():
    sources = {name: path.read_text() for name, path in modules().items()}
    apps = {name: typer_apps(ast.parse(text)) for name, text in sources.items()}
    assert any(apps.values())  # the commands' app is found, so the commands are what is exempt
    found = {name: bad for name, text in sources.items() if (bad := crowded(text, apps))}
    assert found == {}


def test_control_eleven_parameters_are_found_and_only_the_exempt_pass():
    names = ", ".join(f"p{i}" for i in range(11))
    assert crowded(f"def f({names}): ...") == [("f", 1, 11)]
    assert crowded(f"def f(p0, *, {names[4:]}): ...") == [("f", 1, 11)]  # keyword-only ones count
    assert crowded("def f(p0, p1, p2, p3, p4, p5, p6, p7, p8, *a, **k): ...") == [("f", 1, 11)]
    assert crowded(f"class C:\n    def f(self, {names[4:]}): ...") == []  # self is not one
    assert crowded(f"class C:\n    def f(self, {names}): ...") == [("f", 2, 11)]
    assert crowded(f"import triton\n@triton.jit\ndef k({names}): ...") == []
    command = f"@app.command()\ndef cmd({names}): ...\n"
    assert crowded("import typer\napp = typer.Typer()\n" + command) == []
    assert crowded("from tfq.cli.app import app\n" + command, {"tfq.cli.app": {"app"}}) == []
    assert crowded("app = object()\n" + command) == [("cmd", 3, 11)]  # not a Typer app: not exempt
    assert crowded(f"import typer\napp = typer.Typer()\n@app.other()\ndef cmd({names}): ...") == [("cmd", 4, 11)]
