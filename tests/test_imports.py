"""The package's shape: the import graph of posttrain/ (every `import`, function-local ones too) has no
cycle, no module imports another module's `_private` name, `losses/` imports nothing from `models/`,
`rewards/` nothing from `agentic/`, `agentic/` nothing from `tasks/`; the library (everything but
`demos/`, and the CLI, the face above everything, which loads a demo inside its `demo` command) never
imports `demos/`; no recipe module under trainers/ imports another or is over 220 lines.

`models/` imports nothing from the tokenizer (a folder's GGUF export with its tokenizer is runs.py's).
The engine, `train/`, imports nothing from the recipe driver (`recipes/`), the recipes (`trainers/`),
rewards, evals, data or the tokenizer."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "posttrain")


def _modules() -> dict[str, str]:
    """module name -> file, for every .py under posttrain/ (a package is its __init__.py)."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _imports(mods: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """(importer, imported module, imported name or None) for every posttrain import."""
    out = []
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, level - 1 packages up
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out.append((mod, full, None) if full in mods else (mod, base, a.name))
    resolved = []
    for src, target, name in out:
        if not target.startswith("posttrain"):
            continue
        while target not in mods:  # posttrain.x.y.attr -> the module that defines it
            target = target.rpartition(".")[0]
        resolved.append((src, target, name))
    return resolved


MODS = _modules()
IMPORTS = _imports(MODS)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    edges: dict[str, set[str]] = {}
    for src, target, _ in IMPORTS:
        if src != target:
            edges.setdefault(src, set()).add(target)
    assert _cycles(edges) == []


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"posttrain.a": {"posttrain.b"}, "posttrain.b": {"posttrain.a"}}) == [["posttrain.a", "posttrain.b"]]


def test_no_module_imports_another_modules_private_name():
    private = [(src, f"{target}.{name}") for src, target, name in IMPORTS
               if name and name.startswith("_") and not name.startswith("__") and src != target]
    assert private == []


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("low,high", [
    ("posttrain.losses", "posttrain.models"),
    ("posttrain.rewards", "posttrain.agentic"),
    ("posttrain.agentic", "posttrain.tasks"),
    ("posttrain.rl", "posttrain.recipes"),  # rollouts and the critic module sit below the recipe driver
    ("posttrain.models", "posttrain.tokenizer"),
])
def test_layers_do_not_import_upward(low, high):
    wrong = [(src, target) for src, target, _ in IMPORTS if _under(src, low) and _under(target, high)]
    assert wrong == []


ABOVE_THE_ENGINE = ("posttrain.recipes", "posttrain.trainers", "posttrain.rewards", "posttrain.evals",
                    "posttrain.data", "posttrain.tokenizer")


def test_the_engine_imports_no_recipe_reward_evaluator_data_or_tokenizer():
    wrong = [(src, target) for src, target, _ in IMPORTS
             if _under(src, "posttrain.train") and any(_under(target, high) for high in ABOVE_THE_ENGINE)]
    assert wrong == []
    assert any(_under(src, "posttrain.recipes") and _under(t, "posttrain.train") for src, t, _ in IMPORTS)


def test_the_library_never_imports_the_demos():
    wrong = [(src, target) for src, target, _ in IMPORTS
             if _under(target, "posttrain.demos") and not _under(src, "posttrain.demos") and src != "posttrain.cli"]
    assert wrong == []
    assert ("posttrain.cli", "posttrain.demos.demo", None) in IMPORTS  # the check sees the CLI's lazy import


def test_no_trainer_imports_another():
    wrong = [(src, target) for src, target, _ in IMPORTS
             if _under(src, "posttrain.trainers") and _under(target, "posttrain.trainers") and src != target]
    assert wrong == []


def test_the_graph_sees_function_local_imports():
    assert ("posttrain.cli", "posttrain.pipeline", "Pipeline") in IMPORTS  # imported inside cli._run


def test_recipe_modules_stay_small():
    folder = os.path.join(ROOT, "trainers")
    sizes = {f: sum(1 for _ in open(os.path.join(folder, f))) for f in os.listdir(folder) if f.endswith(".py")}
    assert len(sizes) >= 7 and {f: n for f, n in sizes.items() if n > 220} == {}
