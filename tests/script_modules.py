"""The files of scripts/ imported as modules by the tests (they are scripts, not a package)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, module_name: str | None = None):
    """A fresh module of scripts/<name>.py, named `module_name` (default `name`)."""
    spec = importlib.util.spec_from_file_location(module_name or name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
