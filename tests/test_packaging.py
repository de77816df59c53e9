"""Packaging: pyproject.toml holds only build and tool settings, setup.cfg the metadata and entry points;
the installed distribution exposes the `agentfly-train` console script and the environment entry points."""
import ast
import configparser
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "agentfly-jax"
ENV_GROUP = "agentfly_jax.environments"
# Metadata that setup.cfg owns; pyproject.toml must not declare any of it a second time.
SETUP_CFG_FIELDS = {"name", "version", "description", "readme", "license", "classifiers",
                    "requires-python", "dependencies", "optional-dependencies", "scripts", "gui-scripts",
                    "entry-points", "dynamic"}


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _cfg_entry_points(cfg: configparser.ConfigParser) -> dict[str, dict[str, str]]:
    groups = {}
    for group, value in cfg["options.entry_points"].items():
        lines = [line.strip() for line in value.splitlines()]
        lines = [line for line in lines if line and not line.startswith("#")]
        groups[group] = dict((part.strip() for part in line.split("=", 1)) for line in lines)
    return groups


def _installed_entry_points(group: str) -> dict[str, str]:
    return {ep.name: ep.value for ep in metadata.distribution(DIST).entry_points if ep.group == group}


def test_pyproject_has_build_system_and_tool_settings_only():
    data = _pyproject()
    requires = data["build-system"]["requires"]
    assert any(r.startswith("setuptools") for r in requires) and "wheel" in requires
    assert data["build-system"]["build-backend"] == "setuptools.build_meta"
    assert set(data) <= {"build-system", "tool"}, f"unexpected tables {set(data) - {'build-system', 'tool'}}"
    duplicated = SETUP_CFG_FIELDS & set(data.get("project", {}))
    assert not duplicated, f"pyproject.toml repeats setup.cfg metadata: {sorted(duplicated)}"
    assert data["tool"]["ruff"]["line-length"] == 110
    assert "--strict-markers" in data["tool"]["pytest"]["ini_options"]["addopts"]


def test_setup_cfg_is_the_single_metadata_home():
    cfg = _setup_cfg()
    assert cfg["metadata"]["name"] == DIST
    assert cfg["metadata"]["version"]
    assert cfg["options"]["install_requires"].strip()
    assert {"test", "envs", "dev"} <= set(cfg["options.extras_require"])
    # Tool settings moved to pyproject.toml: a second copy here would be silently ignored or disagree.
    assert not cfg.has_section("tool:pytest") and not cfg.has_section("flake8")


def test_pytest_reads_its_options_from_pyproject(request):
    assert request.config.inipath is not None and request.config.inipath.name == "pyproject.toml"
    markers = {line.split(":", 1)[0].strip() for line in request.config.getini("markers")}
    assert {"slow", "docker", "vllm"} <= markers
    assert request.config.option.strict_markers


def test_installed_entry_points_match_setup_cfg():
    """The installed metadata is current; if not, rerun `bash scripts/setup.sh` (it reinstalls on change)."""
    expected = _cfg_entry_points(_setup_cfg())
    for group, entries in expected.items():
        assert _installed_entry_points(group) == entries, group


def test_console_script_agentfly_train_is_installed():
    assert _installed_entry_points("console_scripts").get("agentfly-train") == "agentfly_jax.train:cli"
    script = Path(sys.executable).parent / "agentfly-train"
    assert script.is_file() and os.access(script, os.X_OK), f"{script} missing"


@pytest.mark.slow
def test_agentfly_train_help(tmp_path):
    script = Path(sys.executable).parent / "agentfly-train"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    # From an unrelated directory: the installed script must not depend on the repo being the cwd.
    proc = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-3000:]}"
    assert "--config" in out, out[-3000:]


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_environment_entry_points_name_existing_env_spec():
    """Checked on the source (ast), not by importing: importing an environment may start Java, Docker etc."""
    entries = _installed_entry_points(ENV_GROUP)
    assert {"arithmetic", "code_interpreter", "webshop", "search", "alfworld", "scienceworld"} <= set(entries)
    problems = []
    for name, value in sorted(entries.items()):
        module, _, attr = value.partition(":")
        if not module.startswith("environments.") or attr != "env_spec":
            problems.append(f"{name}: {value!r} is not environments.<module>:env_spec")
            continue
        base = ROOT.joinpath(*module.split("."))
        path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
        if path is None:
            problems.append(f"{name}: no module file for {module}")
        elif attr not in _top_level_names(ast.parse(path.read_text(), filename=str(path))):
            problems.append(f"{name}: {path.relative_to(ROOT)} defines no {attr}")
    assert not problems, "\n".join(problems)
