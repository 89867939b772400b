"""Imports a module of Triton kernels compiled on CUDA, else built for Triton's CPU interpreter.

triton.jit picks interpreter or compiler at decoration time, triton's own library functions
included, and conftest's imports (torch, transformers) have usually imported triton already:
then triton is imported afresh with TRITON_INTERPRET=1, and with it every kernel module of
kvserve that was decorated before.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

KERNEL_MODULES = ("kernels.triton_attention", "kernels.triton_quant_linear")


def import_kernels(module: str) -> ModuleType:
    """`module` (one of KERNEL_MODULES), compiled on CUDA or interpreted on CPU."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        standard = sys.modules.get("triton.language.standard")
        if standard is not None and type(standard.zeros).__name__ != "InterpretedFunction":
            # triton._C (the compiled extension) cannot be loaded twice: keep it.
            stale = [name for name in sys.modules if name in KERNEL_MODULES or (
                (name == "triton" or name.startswith("triton.")) and
                not name.startswith("triton._C"))]
            for name in stale:
                del sys.modules[name]
    return importlib.import_module(module)
