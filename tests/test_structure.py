"""The package's shape, read from its source with `ast` (comments and strings do not count): one module reads
the environment and the README lists every variable it knows; no import cycles (imports inside functions
count, `if TYPE_CHECKING:` ones do not); kernels import no layer, model, cache, engine, speculation, server or
benchmark; no file over MAX_LINES lines."""
from __future__ import annotations

import ast
from pathlib import Path

from hf2q import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hf2q"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of src/hf2q."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _environ_uses(tree: ast.AST) -> list[int]:
    """Lines that name os.environ, os.getenv, os.putenv or os.unsetenv, or import them from os."""
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in names for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment():
    """Every environment variable goes through hf2q.envs, where it is typed and documented."""
    offenders = {name: lines for name, path in _modules().items() if name != "hf2q.envs"
                 for lines in [_environ_uses(ast.parse(path.read_text(), str(path)))] if lines}
    assert not offenders, f"os.environ outside hf2q/envs.py (module: lines): {offenders}"


def test_readme_documents_every_variable():
    """The README's one "Environment variables" table names each variable envs.py knows."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count("## Environment variables") == 1
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    missing = [var.name for var in envs.VARIABLES if f"`{var.name}`" not in section]
    assert not missing, f"not in the README's Environment variables table: {missing}"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, name: str, is_package: bool, modules) -> set[str]:
    """Dotted names a module imports, anywhere but under `if TYPE_CHECKING:`: `from a import b` gives a.b
    where that is a module, else a."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the hf2q modules it imports (`import a.b.c` stands for the longest of them that is a module)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles():
    """No module of src/hf2q imports, at any depth, a module that imports it back."""
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _above_kernels(module: str) -> bool:
    """Layers, models, the cache, the engine, speculation, the server and the benchmarks: what kernels must not
    import (a kernel's format tables, such as the K/V codecs', live in modules of their own)."""
    top = module.split(".")[1] if "." in module else ""
    return top in ("layers", "models", "cache", "engine", "spec", "server", "bench", "bench_shapes") \
        or module.endswith("_bench")


def test_kernels_import_nothing_above_them():
    """kernels/ is the bottom of the math: it imports no layer, model, cache, engine, speculation, server or
    benchmark."""
    wrong = sorted(f"{src} -> {dst}" for src, edges in import_graph().items() if src.startswith("hf2q.kernels")
                   for dst in edges if _above_kernels(dst))
    assert not wrong, wrong


MAX_LINES = 500


def test_no_source_file_over_max_lines():
    """Every file of src/hf2q fits in MAX_LINES lines."""
    lengths = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
               for path in _modules().values()}
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines: {too_long}"
