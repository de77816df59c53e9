"""Runs every fenced code block of docs/custom_task.md, so the tutorial cannot drift from the code.

What happens to a block is decided by its fence's info string:

- ```python file=PATH and ```jsonl file=PATH: a file of the tutorial's package (`shelf_task/...`). All of
  them are written first, under a temporary project directory that is on `sys.path` (and on PYTHONPATH for
  the bash blocks), as a user creates their files; then, walking the doc in order, each python file block is
  imported as a module at its place (`shelf_task/tools.py` -> `shelf_task.tools`).
- ```python: executed in document order, ALL python blocks in ONE shared namespace (a block may use names
  an earlier block defined, as a reader running the page top to bottom would), with the project directory
  as the working directory. Tracebacks point at the doc's line numbers.
- ```bash: run with `bash -euo pipefail` from the repository root, with the venv's bin first on PATH (so
  `agentfly-train` is the installed console script) and PROJECT / PYTHONPATH / WORKDIR set as the doc's
  `no-run` export block tells a user to set them (WORKDIR: a temporary directory). These are the slow part
  (several CPU training runs of about a minute each).
- a block whose info string holds `no-run` is not run (an export line to adapt, the real-checkpoint command,
  packaging metadata).

Any other block makes `test_every_block_is_run_or_marked` fail, so a new block is never skipped silently.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "custom_task.md"
VENV_BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(.*)$")
NO_RUN = "no-run"
EXECUTED_LANGUAGES = ("python", "bash")  # without file=: run
FILE_LANGUAGES = ("python", "jsonl")  # with file=PATH: written (python files also imported)
HARNESS_ENV = ("PROJECT", "PYTHONPATH", "WORKDIR")  # what the harness sets for the bash blocks


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of the first code line in the doc
    info: str
    code: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def options(self) -> dict[str, str]:
        return dict(word.partition("=")[::2] for word in self.info.split()[1:])

    @property
    def kind(self) -> str:
        """'no-run', 'file', 'python' or 'bash'; ValueError for a block the harness would not know to run."""
        if NO_RUN in self.info.split():
            return "no-run"
        if "file" in self.options:
            if self.language not in FILE_LANGUAGES or not self.options["file"]:
                raise ValueError(f"docs/custom_task.md:{self.line}: file blocks are {FILE_LANGUAGES} "
                                 f"with file=PATH, got ```{self.info}")
            return "file"
        if self.language in EXECUTED_LANGUAGES and len(self.info.split()) == 1:
            return self.language
        raise ValueError(f"docs/custom_task.md:{self.line}: ```{self.info} is neither run by the doc test "
                         f"(python, bash, python/jsonl file=PATH) nor marked `{NO_RUN}`")


def parse_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i + 1
        end = start
        while end < len(lines) and lines[end] != "```":
            end += 1
        assert end < len(lines), f"docs/custom_task.md:{i + 1}: unclosed code fence"
        code = "\n".join(lines[start:end]) + "\n"
        blocks.append(Block(line=start + 1, info=match.group(1).strip(), code=code))
        i = end + 1
    return blocks


@pytest.fixture(scope="module")
def blocks() -> list[Block]:
    return parse_blocks(DOC.read_text())


def write_files(blocks: list[Block], project: Path) -> list[str]:
    """Writes every file block under `project`; returns the top-level package names they make."""
    packages = set()
    for block in blocks:
        if block.kind == "file":
            path = project / block.options["file"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.code)
            packages.add(Path(block.options["file"]).parts[0])
    return sorted(packages)


def module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.fixture
def project(tmp_path, blocks, monkeypatch):
    """The tutorial's project directory with its files written, importable, as the working directory; the
    tutorial's modules, registered environment, tools and rewards are removed again afterwards."""
    from agentfly_jax.envs import spec as spec_module
    from agentfly_jax.rewards.decorator import REWARD_REGISTRY
    from agentfly_jax.tools.decorator import TOOL_REGISTRY

    directory = tmp_path / "project"
    directory.mkdir()
    packages = write_files(blocks, directory)
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.chdir(directory)
    importlib.invalidate_caches()
    before_envs = dict(spec_module._FACTORIES)
    yield directory

    def ours(name):
        return name.split(".")[0] in packages

    for name in [m for m in sys.modules if ours(m)]:
        del sys.modules[name]
    spec_module._FACTORIES.clear()
    spec_module._FACTORIES.update(before_envs)
    for registry in (TOOL_REGISTRY, REWARD_REGISTRY):
        for key in [k for k, v in registry.items() if ours(getattr(v.func, "__module__", ""))]:
            del registry[key]


# -------------------------------------------------------------------------------------------------- tests
def test_every_block_is_run_or_marked(blocks):
    kinds = [block.kind for block in blocks]  # raises, naming the line, for a block nobody runs
    for kind in ("file", "python", "bash", "no-run"):
        assert kind in kinds, f"the doc has no {kind} block any more: is the harness still right?"
    no_run = [b for b in blocks if b.kind == "no-run"]
    # The real-checkpoint command is shown, not run; the export block names exactly what the harness sets.
    assert any("hf_path" in b.code and "agentfly-train" in b.code for b in no_run)
    exported = {m.group(1) for b in no_run if b.language == "bash"
                for m in re.finditer(r"export (\w+)=", b.code)}
    assert exported == set(HARNESS_ENV), exported
    # every bash block that runs uses the harness's variables only, and trains CPU-sized
    for block in blocks:
        if block.kind == "bash":
            used = set(re.findall(r"\$(\w+)", block.code))
            assert used <= set(HARNESS_ENV), f"docs/custom_task.md:{block.line}: unknown variables {used}"
            for command in re.findall(r"agentfly-train [^\n]*", block.code):
                assert ":cpu" in command, f"docs/custom_task.md:{block.line}: {command}"


def test_python_blocks(blocks, project):
    """The python file blocks import and the python blocks run, in order, in one namespace."""
    namespace: dict = {"__name__": "custom_task_doc"}
    ran = 0
    for block in blocks:
        if block.kind == "file" and block.language == "python":
            importlib.import_module(module_name(block.options["file"]))
        elif block.kind == "python":
            code = compile("\n" * (block.line - 1) + block.code, str(DOC), "exec")
            exec(code, namespace)  # noqa: S102 - the doc's own examples
            ran += 1
    assert ran >= 5
    # what the blocks claim, checked once more from the outside
    assert namespace["took"].ok and namespace["looked"].observation == "3 apple, 3 pear"
    assert [t.reward for t in namespace["trajectories"]] == [1.0, 1.0]


@pytest.mark.slow
def test_bash_blocks(blocks, project, tmp_path):
    """The doc's training commands run (CPU-sized) and write what the doc says a run writes."""
    workdir = tmp_path / "runs"
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "PROJECT": str(project), "PYTHONPATH": str(project), "WORKDIR": str(workdir)}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it (conftest fakes 8)
    runs = []
    for block in blocks:
        if block.kind != "bash":
            continue
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (f"docs/custom_task.md:{block.line} failed:\n{block.code}\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        runs += re.findall(r"--config\.workdir=\$WORKDIR/(\w+)", block.code)
    assert len(runs) >= 4, runs
    from agentfly_jax.trainer.metrics import read_scalars

    for name in runs:
        run = workdir / name
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 1 and {"success_before", "success_after"} <= set(summary)
        assert (Path(summary["final_policy"]) / "model.safetensors").is_file()
        scalars = read_scalars(str(run / "tensorboard"))
        for tag in ("reward/mean", "rollout/tool_calls", "rollout/tool_errors", "success/rate"):
            assert [step for step, _ in scalars[tag]] == [1], (name, tag)
        # the shelf runs score in the chain's environment (4 chains), the others have no pool
        acquired = 4.0 if name.startswith("shelf") else 0.0
        assert scalars["rollout/envs_acquired"] == [(1, acquired)], (name, scalars["rollout/envs_acquired"])
    # the plugin run evaluated its two held-out rows before and after the step
    shelf = json.loads((workdir / "shelf" / "summary.json").read_text())
    assert shelf["environment"] == "shelf_task.spec:env_spec"
    assert 0.0 <= shelf["success_before"] <= 1.0 and 0.0 <= shelf["success_after"] <= 1.0
    prices = json.loads((workdir / "prices" / "summary.json").read_text())
    assert prices["environment"].endswith("shelf_task/prices.jsonl")


def test_harness_refuses_an_unmarked_block():
    """The check above is real: a block the harness does not run and that is not marked `no-run` fails."""
    for info in ("sh", "", "python extra", "yaml file=x.yaml"):
        (block,) = parse_blocks(f"text\n```{info}\necho hi\n```\n")
        with pytest.raises(ValueError, match="docs/custom_task.md:3"):
            block.kind  # noqa: B018
    assert [b.kind for b in parse_blocks("```sh no-run\nx\n```\n```jsonl file=a.jsonl\n{}\n```\n")] == [
        "no-run", "file"]
