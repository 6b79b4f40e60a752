"""The package's shape, read from its source with `ast` (comments and strings do not count): one module reads
the environment, and every variable it knows is in the README."""
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
