"""The house rules of the source tree, checked from the code itself (no imports executed, except
the one subprocess that imports the client).

Imports flow one way. Each module of the installed package belongs to one layer and may import
only from the layers listed for it (docs/architecture.md, "Layout"):

    entry     pdserve (the package), pdserve.cli              anything
    services  pdserve.services.*                              engine, api, base
    engine    the rest of pdserve.*                           the pdserve.kernels package, api, base
    kernels   pdserve.kernels.*                               base
    api       pdserve.v1.*, sampling_params, outputs,         base
              client, bench_serve (no torch)
    base      pdserve.envs                                    nothing of pdserve

Outside pdserve.kernels, the kernels are reached through the package (``get_backend`` and its
package-level functions), never through ``pdserve.kernels.cpu`` and the like.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder, as pyproject.toml's package-dir maps them
FOLDERS = {
    "pdserve": ROOT / "pdserve",
    "pdserve.kernels": ROOT / "kernels",
    "pdserve.services": ROOT / "services",
}
API = (
    "pdserve.v1",
    "pdserve.sampling_params",
    "pdserve.outputs",
    "pdserve.client",
    "pdserve.bench_serve",
)
MAY_IMPORT = {
    "entry": {"entry", "services", "engine", "kernels", "api", "base"},
    "services": {"services", "engine", "api", "base"},
    "engine": {"engine", "kernels", "api", "base"},
    "kernels": {"kernels", "base"},
    "api": {"api", "base"},
    "base": {"base"},
}


def layer(module: str) -> str:
    if module in ("pdserve", "pdserve.cli"):
        return "entry"
    if module == "pdserve.envs":
        return "base"
    if any(module == a or module.startswith(a + ".") for a in API):
        return "api"
    for name in ("kernels", "services"):
        if module == f"pdserve.{name}" or module.startswith(f"pdserve.{name}."):
            return name
    return "engine"


def source_modules() -> dict[str, Path]:
    """Every module of the package, by import name (generated stubs left out)."""
    modules = {}
    for base, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            if base == "pdserve" and parts and parts[0] in ("kernels", "services"):
                continue  # no such folders under pdserve/ (they would shadow the mapping)
            modules[".".join([base, *parts])] = path
    return modules


def _import_nodes(node: ast.AST, typing_too: bool):
    """Import statements under ``node``, at any depth; those under ``if TYPE_CHECKING:`` only
    when ``typing_too`` (they never run)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            if typing_too:
                yield from _import_nodes(child, typing_too)
            else:
                for other in child.orelse:
                    yield from _import_nodes(other, typing_too)
        else:
            yield from _import_nodes(child, typing_too)


def imports(path: Path, module: str, known: set[str], typing_too: bool = True):
    """(imported module, line) for each import in ``path``, function-level ones included;
    ``from X import y`` counts as X.y when that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _import_nodes(tree, typing_too):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        else:
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


def test_lower_layers_never_import_upper_ones():
    modules = source_modules()
    known = set(modules)
    wrong = []
    for module, path in sorted(modules.items()):
        mine = layer(module)
        for target, line in imports(path, module, known):
            if target.split(".")[0] in ("kernels", "services"):
                wrong.append(f"{module}:{line} imports top-level {target!r}: use pdserve.{target}")
                continue
            if not target.startswith("pdserve") or target == "pdserve":
                continue
            theirs = layer(target)
            if theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{module}:{line} ({mine}) imports {target} ({theirs})")
            elif mine not in ("kernels", "entry") and target.startswith("pdserve.kernels."):
                wrong.append(f"{module}:{line} reaches past the kernels package into {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    """Between modules, counting imports inside functions too (a cycle dodged by importing in a
    function is still a cycle); imports only for type checkers do not count."""
    modules = source_modules()
    known = set(modules)
    graph = {
        m: {t for t, _ in imports(p, m, known, typing_too=False) if t in known and t != m}
        for m, p in modules.items()
    }
    graph["pdserve"] = set()  # the package's lazy attributes (pdserve.LLM) are its API, not a cycle
    # Tarjan's strongly connected components, iteratively
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        cycles.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_tests_and_benchmarks_use_the_pdserve_names():
    wrong = []
    for folder in ("tests", "bench", "proto", "deploy", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for target, line in imports(path, "", set()):
                if target.split(".")[0] in ("kernels", "services"):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports top-level {target!r}")
    assert not wrong, "\n".join(wrong)


def test_the_wheel_lists_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {k: ROOT / v for k, v in config["package-dir"].items()} == FOLDERS
    folders = set()
    for base, folder in FOLDERS.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            if base == "pdserve" and parts and parts[0] in ("kernels", "services"):
                continue
            folders.add(".".join([base, *parts]))
    assert set(config["packages"]) == folders


def test_importing_the_client_does_not_load_torch():
    code = "import sys, pdserve.client, pdserve.v1.convert; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_test_files_have_unique_names():
    """pytest imports test files by base name (the test folders are not packages): two with one
    name make the second fail to collect."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
