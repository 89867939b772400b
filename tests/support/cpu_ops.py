"""kvserve's C++ CPU ops for the tests: on a CPU the ops target (x86-64 with AVX2, aarch64) a
missing build fails the tests that need it, since `make setup` must have built it; only on
other CPUs are those tests skipped. No test skips the host's fast path."""

from __future__ import annotations

from typing import Any

import pytest

from kernels import cpu_ops


def require_cpu_ops() -> Any:
    """`torch.ops.kvserve_cpu`, loading (building) it if needed; fails the calling module where
    it should have built, skips it on a CPU the ops do not support."""
    ops = cpu_ops.load()
    if ops is not None:
        return ops
    reason = cpu_ops.unsupported_reason()
    if reason:
        pytest.skip(f"kvserve's C++ CPU ops do not target this CPU: {reason}",
                    allow_module_level=True)
    pytest.fail("kvserve's C++ CPU ops did not build on a CPU they support (see the WARNING "
                "above; `python -m kernels.cpu_ops` shows the compiler's errors)",
                pytrace=False)
