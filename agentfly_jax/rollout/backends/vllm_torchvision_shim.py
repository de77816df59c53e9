"""Lets torchvision's Python code import in the CPU vLLM environment, where its C++ operators cannot load.

vLLM 0.32's Qwen2-VL / Qwen2.5-VL code imports transformers' torchvision image and video processors, so serving a
vision-language model needs `import torchvision`. The only torchvision wheel for torch 2.13 that PyPI has is built
against CUDA torch: its `_C` extension (nms, roi_align, ...) fails to load beside the CPU torch, which torchvision
tolerates (it then has no operators), except that `torchvision._meta_registrations` registers fake kernels for
`torchvision::nms` and `torchvision::qnms` without checking, and `torch.library.register_fake` fails for an
operator that was never defined ("operator torchvision::nms does not exist"), so `import torchvision` fails.

This module, imported at interpreter start-up through a `.pth` file (scripts/setup_vllm.sh installs both into
.venv-vllm), waits for that import: right before `torchvision._meta_registrations` runs, and only when torchvision
loaded no operators, it defines the schemas of those two operators, without any kernel. Everything the image
processors use (`torchvision.transforms.v2.functional`: resize, rescale, normalise on tensors) is plain torch and
works; calling `torchvision.ops.nms` raises torch's "no kernel" error. Nothing is done when torchvision's
operators load (a CUDA machine with a matching torchvision), and nothing is imported before torchvision is.
It runs in the vLLM environment and imports nothing from agentfly_jax.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "torchvision._meta_registrations"
_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def _define_missing_operators() -> None:
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():
        return
    for name in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{name}", _SCHEMA)
        except RuntimeError:  # defined already (a second interpreter-level import, or a newer torchvision)
            pass


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `torchvision._meta_registrations` as usual and defines the missing operators before it executes."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            _define_missing_operators()
            execute(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Puts the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
