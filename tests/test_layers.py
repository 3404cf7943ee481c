"""Imports run downward (STYLE #14): no cycle in finetune/'s import graph, so no module imports one of its callers,
and the weights path keeps its layers. Read from the source with `ast`, function-level imports included."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "finetune"
# what each layer of the weights path must not import (besides the cycle check, which covers everything)
BUILDING = {"finetune.model", "finetune.load", "finetune.tools.plan", "finetune.export", "finetune.tools.prepare",
            "finetune.hf.verify", "finetune.train", "finetune.tools.bench", "finetune.cli"}
FORBIDDEN = {"finetune.checkpoint": BUILDING, "finetune.adapters.lora": BUILDING - {"finetune.model"},
             "finetune.load": BUILDING - {"finetune.load"},
             "finetune.hf.verify": {"finetune.export", "finetune.tools.prepare"}}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the modules of ours it imports anywhere in its source}."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from . import checkpoint`: the submodule, where one of that name exists
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = 2
        path.pop()
        return None
    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "finetune.train" in graph and "finetune.data.labels" in graph  # the walk sees the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_weights_path_imports_downward_only():
    graph = import_graph()
    assert "finetune.weights" in graph and "finetune.load" in graph, "the bottom of the weights path is missing"
    assert graph["finetune.weights"] <= {"finetune.errors"}, graph["finetune.weights"]
    wrong = {m: sorted(graph[m] & banned) for m, banned in FORBIDDEN.items() if graph[m] & banned}
    assert not wrong, f"imports that run up the weights path: {wrong}"


def test_the_check_sees_lazy_imports_and_cycles(tmp_path):
    pkg = tmp_path / "finetune"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub.b import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom ..c import x\n")
    (pkg / "c.py").write_text("import json\n")
    graph = import_graph(pkg)
    assert graph == {"finetune": set(), "finetune.a": {"finetune.sub.b"}, "finetune.sub": set(),
                     "finetune.sub.b": {"finetune.a", "finetune.c"}, "finetune.c": set()}
    assert find_cycle(graph) == ["finetune.a", "finetune.sub.b", "finetune.a"]


LOOKUPS = re.compile(r"import_module\(|find_spec\(|__import__\(")


def own_module_lookups(root: Path = ROOT) -> list[str]:
    """The lines that look one of the package's own modules up by name (importlib), as 'path:line: text': a reader and
    go-to-definition cannot follow such an import. Lookups of third-party packages (is flash_attn installed?) pass."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if LOOKUPS.search(line) and ("finetune" in line or re.search(r"\(f?[\"']\.", line) or "{" in line):
                found.append(f"{path.relative_to(root.parent)}:{i}: {line.strip()}")
    return found


def test_every_module_of_a_run_is_reached_by_an_import_statement():
    """No module of ours is looked up by name (the optional-extension lookups are gone: every install runs the same
    checks, recipe and template handling); the CLI imports what every run uses."""
    assert own_module_lookups() == []
    graph = import_graph()
    assert {"finetune.train", "finetune.export", "finetune.preflight", "finetune.run.checks", "finetune.run.console",
            "finetune.run.rank_errors", "finetune.tools.commands"} <= graph["finetune.cli"], graph["finetune.cli"]
    assert {"finetune.build", "finetune.run.report", "finetune.run.saving", "finetune.data.chat_template"} <= \
        graph["finetune.train"], graph["finetune.train"]
    assert {"finetune.hf.verify", "finetune.hf.passthrough", "finetune.run.pins"} <= graph["finetune.export"]


def test_the_lookup_check_sees_a_lookup_by_name(tmp_path):
    pkg = tmp_path / "finetune"
    pkg.mkdir()
    (pkg / "a.py").write_text("import importlib\nm = importlib.import_module(f'finetune.kernels.{name}')\n")
    (pkg / "b.py").write_text("import importlib.util\nok = importlib.util.find_spec('flash_attn') is not None\n")
    (pkg / "c.py").write_text("import importlib.util\nx = importlib.util.find_spec(f'.{n}', 'finetune')\n")
    assert [line.split(":")[0] for line in own_module_lookups(pkg)] == ["finetune/a.py", "finetune/c.py"]


# the package's layers, bottom up: a module imports only from its own layer or below (finetune/'s own modules and
# data/ are the bottom; build.py, the one place a capability enters, imports the folders; the loop and the export,
# which import what every run does by name, sit above it; the commands on top)
LAYERS = [{"finetune", "data"}, {"hf", "kernels", "memory"}, {"parallel", "adapters", "run"}, {"tasks"}, {"build"},
          {"train", "export", "preflight", "tools"}, {"cli", "__main__"}]


def layer_of(module: str) -> int:
    """The index in LAYERS of a module's folder (or, in finetune/ itself, of the module when LAYERS names it)."""
    parts = module.split(".")
    unit = parts[1] if len(parts) > 1 else "finetune"
    return next((i for i, units in enumerate(LAYERS) if unit in units), 0)


def test_the_folders_import_downward_only():
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if m.count(".") >= 2} >= {"data", "hf", "kernels", "memory", "parallel",
                                                                    "adapters", "run", "tasks", "tools"}
    upward = sorted(f"{m} -> {d}" for m in graph for d in graph[m] if layer_of(d) > layer_of(m))
    assert not upward, upward


def test_no_module_imports_a_private_name_of_another_folder():
    """`from ..x import _name` across folders couples a folder to another's insides (make it public or pass it)."""
    found = []
    for path in ROOT.rglob("*.py"):
        name = module_name(path, ROOT)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
                if private and base.split(".")[:2] != name.split(".")[:2]:
                    found.append(f"{name}: {base}.{private}")
    assert not found, found
