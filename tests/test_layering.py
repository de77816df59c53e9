"""Layering of `agentfly_jax`: which subpackages may import which, checked on the source with `ast`.

Rules:
- the library never imports the top-level `environments` package;
- `tools` does not import `rollout` (the tool-call format lives in tools, rollout builds on it);
- the subpackage import graph has no cycle;
- `algorithms` and `models` are the pure core: nothing from rollout, envs, tools, rewards or trainer.

Every import counts, wherever it is (module level, inside functions, under `if TYPE_CHECKING:`), and so
does `importlib.import_module("...")` with a literal name: a lazy import hides a dependency, it does not
remove it.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = "agentfly_jax"
REPO_ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_TOP_LEVEL = "environments"
CORE = ("algorithms", "models")
NOT_FOR_CORE = ("rollout", "envs", "tools", "rewards", "trainer")


@dataclasses.dataclass(frozen=True)
class ImportSite:
    """One imported module name and where it is imported: `path:line` relative to the source root."""

    path: str
    line: int
    importer: str  # the importing file's module, e.g. "agentfly_jax.tools.execute"
    target: str  # absolute module name, e.g. "agentfly_jax.tools.parsers"

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute module names `node` imports (none when it is no import).

    `from a import b` yields "a", and "a.b" too when "a" is a top-level package: there b may be a
    subpackage (`from agentfly_jax import rollout`); deeper, "a" already names the subpackage.
    """
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = package[: len(package) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        if "." in prefix:
            return [prefix]
        return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names if alias.name != "*"]
    if (
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
        )
    ):
        return [node.args[0].value]
    return []


def collect_imports(root: Path, package: str = PACKAGE) -> list[ImportSite]:
    """Every import in every .py file under `root/package`, relative imports resolved."""
    sites = []
    for path in sorted((root / package).rglob("*.py")):
        module = _module_name(path, root)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            for target in _targets(node, module, is_package):
                sites.append(ImportSite(path.relative_to(root).as_posix(), node.lineno, module, target))
    return sorted(sites, key=lambda site: (site.path, site.line, site.target))


def subpackage_of(module: str, package: str = PACKAGE) -> str | None:
    """The subpackage holding `module` ("rollout" for agentfly_jax.rollout.agents.base), else None."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == package else None


def subpackage_edges(
    sites: list[ImportSite], root: Path, package: str = PACKAGE
) -> dict[tuple[str, str], list[ImportSite]]:
    """(importer subpackage, imported subpackage) -> the import sites that make the edge."""
    subpackages = {p.parent.name for p in (root / package).glob("*/__init__.py")}
    edges: dict[tuple[str, str], list[ImportSite]] = defaultdict(list)
    for site in sites:
        source, target = subpackage_of(site.importer, package), subpackage_of(site.target, package)
        if source in subpackages and target in subpackages and source != target:
            edges[source, target].append(site)
    return dict(edges)


def find_cycle(edges: dict[tuple[str, str], list[ImportSite]]) -> list[str] | None:
    """One cycle of the graph as its nodes [a, b, ..., a], or None when the graph is acyclic."""
    graph: dict[str, list[str]] = defaultdict(list)
    for source, target in sorted(edges):
        graph[source].append(target)
    done: set[str] = set()
    path: list[str] = []  # the depth-first path from the current root

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for successor in graph[node]:
            cycle = visit(successor)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def layering_violations(root: Path, package: str = PACKAGE) -> dict[str, list[str]]:
    """Broken rules by name ("environments", "tools->rollout", "cycle", "core"), each with its reasons."""
    sites = collect_imports(root, package)
    edges = subpackage_edges(sites, root, package)
    violations: dict[str, list[str]] = {}

    # One line per statement: `from environments import a` yields "environments" and "environments.a".
    environments, reported = [], set()
    for site in sites:
        if site.target.split(".")[0] == FORBIDDEN_TOP_LEVEL and (site.path, site.line) not in reported:
            reported.add((site.path, site.line))
            environments.append(str(site))
    if environments:
        violations["environments"] = environments

    tools_to_rollout = [str(site) for site in edges.get(("tools", "rollout"), [])]
    if tools_to_rollout:
        violations["tools->rollout"] = tools_to_rollout

    cycle = find_cycle(edges)
    if cycle:
        lines = [" -> ".join(cycle)]
        for source, target in zip(cycle, cycle[1:]):
            lines += [f"  {source} -> {target}: {site}" for site in edges[source, target]]
        violations["cycle"] = lines

    core = [
        f"{source} -> {target}: {site}"
        for (source, target), edge_sites in sorted(edges.items())
        if source in CORE and target in NOT_FOR_CORE
        for site in edge_sites
    ]
    if core:
        violations["core"] = core
    return violations


def _fail_on(violations: dict[str, list[str]], rule: str, title: str) -> None:
    if rule in violations:
        pytest.fail(f"{title}:\n" + "\n".join(violations[rule]), pytrace=False)


@pytest.fixture(scope="module")
def repo_violations() -> dict[str, list[str]]:
    return layering_violations(REPO_ROOT)


def test_library_never_imports_the_environments_package(repo_violations):
    _fail_on(repo_violations, "environments", "agentfly_jax imports the environments package")


def test_tools_do_not_import_rollout(repo_violations):
    _fail_on(repo_violations, "tools->rollout", "agentfly_jax.tools imports agentfly_jax.rollout")


def test_subpackage_import_graph_is_acyclic(repo_violations):
    _fail_on(repo_violations, "cycle", "subpackages import each other in a cycle")


def test_algorithms_and_models_import_only_the_core(repo_violations):
    _fail_on(repo_violations, "core", "algorithms/models import outside the core")


def test_checker_sees_the_real_package():
    # Guards the checks above against passing vacuously (wrong root, nothing parsed).
    edges = subpackage_edges(collect_imports(REPO_ROOT), REPO_ROOT)
    assert ("rollout", "tools") in edges
    assert ("rewards", "tools") in edges


# --------------------------------------------------------------------------------------------------
# The checker on synthetic trees
# --------------------------------------------------------------------------------------------------


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)


CLEAN_TREE = {
    "agentfly_jax/__init__.py": "",
    "agentfly_jax/algorithms/__init__.py": "from agentfly_jax.algorithms import losses\n",
    "agentfly_jax/algorithms/losses.py": "import math\n",
    "agentfly_jax/models/__init__.py": "",
    "agentfly_jax/tools/__init__.py": "from .parsers import parse\n",
    "agentfly_jax/tools/parsers.py": "import json\n",
    "agentfly_jax/rollout/__init__.py": "",
    "agentfly_jax/rollout/agents.py": "from ..tools import parsers\nfrom agentfly_jax.models import x\n",
    "agentfly_jax/envs/__init__.py": "import importlib\nmod = importlib.import_module('my_env')\n",
}


def test_checker_passes_a_clean_tree(tmp_path):
    _write_tree(tmp_path, CLEAN_TREE)
    assert layering_violations(tmp_path) == {}
    assert set(subpackage_edges(collect_imports(tmp_path), tmp_path)) == {
        ("rollout", "tools"),
        ("rollout", "models"),
    }


def test_checker_reports_each_planted_violation(tmp_path):
    _write_tree(
        tmp_path,
        {
            **CLEAN_TREE,
            # A function-local import of the environments package, and a relative import of rollout
            # from tools (which also closes the cycle rollout -> tools -> rollout).
            "agentfly_jax/tools/execute.py": (
                "import json\n"
                "\n"
                "def run():\n"
                "    from environments.arithmetic import tasks\n"
                "    from ..rollout import agents\n"
            ),
            # The core importing envs through importlib.
            "agentfly_jax/models/hub.py": "import importlib\nimportlib.import_module('agentfly_jax.envs')\n",
        },
    )
    violations = layering_violations(tmp_path)
    execute = "agentfly_jax/tools/execute.py"
    assert violations["environments"] == [f"{execute}:4 imports environments.arithmetic"]
    assert violations["tools->rollout"] == [f"{execute}:5 imports agentfly_jax.rollout"]
    assert violations["cycle"][0] == "rollout -> tools -> rollout"
    assert f"  tools -> rollout: {execute}:5 imports agentfly_jax.rollout" in violations["cycle"]
    rollout_to_tools = "  rollout -> tools: agentfly_jax/rollout/agents.py:1 imports agentfly_jax.tools"
    assert rollout_to_tools in violations["cycle"]
    assert violations["core"] == ["models -> envs: agentfly_jax/models/hub.py:2 imports agentfly_jax.envs"]


def test_checker_finds_a_longer_cycle(tmp_path):
    _write_tree(
        tmp_path,
        {
            **CLEAN_TREE,
            "agentfly_jax/rewards/__init__.py": "from agentfly_jax.tools import parsers\n",
            "agentfly_jax/tools/calculator.py": "def f():\n    import agentfly_jax.envs.spec\n",
            "agentfly_jax/envs/spec.py": "from agentfly_jax import rewards\n",
        },
    )
    cycle = layering_violations(tmp_path)["cycle"]
    assert cycle[0] == "envs -> rewards -> tools -> envs"
    assert "  tools -> envs: agentfly_jax/tools/calculator.py:2 imports agentfly_jax.envs.spec" in cycle
