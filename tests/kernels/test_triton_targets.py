"""The Triton kernels compiled ahead of time for real GPUs (sm_80, sm_89, sm_90) with Triton's
own ptxas, no GPU needed, from the launchers' captured calls (tests/support/triton_targets.py):
every specialization kvserve can launch compiles within each target's registers, spills and
shared memory, and the startup guards refuse exactly the configurations the compiler rejects."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.selector import TRITON_BLOCK_SIZES, check_triton_support, get_attention_backend

pytest.importorskip("triton")
from tests.support.triton_targets import (  # noqa: E402
    GUARD_CASES,
    run_in_fresh_process,
    specializations,
    within_limits,
)


def test_the_guard_refuses_exactly_what_fails_to_compile() -> None:
    rows = run_in_fresh_process("guard_case_rows")
    assert sum(r["ok"] for r in rows) >= 4  # the compiler really ran: the allowed cases pass
    for case, row in zip(GUARD_CASES, rows, strict=True):
        assert row["allowed"] == row["ok"], (case, row.get("error"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_launchable_specialization_compiles_within_each_targets_limits() -> None:
    rows = run_in_fresh_process("compile_all")
    failed = [(r["arch"], r["label"], r["error"]) for r in rows if r["allowed"] and not r["ok"]]
    assert not failed, failed
    over = [(r["arch"], r["label"], within_limits(r)) for r in rows
            if r["ok"] and r["allowed"] and within_limits(r)]
    assert not over, over
    # What the compiler rejects never gets past the guard (fp8 e4m3 on sm_80 here).
    assert all(r["allowed"] is False for r in rows if not r["ok"])
    assert any(not r["ok"] for r in rows)


def test_the_capture_covers_the_issue_matrix() -> None:
    launches = specializations()
    attention = [dict(launch.constexprs) | {"ptrs": {t for _, t in launch.signature}}
                 for launch in launches if launch.kernel == "_attention_kernel"]
    def values(key: str) -> set[Any]:
        return {a[key] for a in attention}
    assert {64, 80, 96, 128, 256} <= values("HEAD_DIM")
    assert set(TRITON_BLOCK_SIZES) <= values("BLOCK_SIZE")
    assert {1, 4, 8} <= values("GROUP") and values("SLIDING") == {False, True}
    assert max(values("NUM_SEGMENTS")) > 1 and len(values("BLOCK_Q")) > 1  # split, prefill
    ptrs = set().union(*(a["ptrs"] for a in attention))
    assert {"*fp16", "*bf16", "*fp32", "*fp8e4nv", "*fp8e5"} <= ptrs
    kernels = {launch.kernel for launch in launches}
    assert kernels == {"_cache_kernel", "_attention_kernel", "_reduce_kernel",
                       "_quant_linear_kernel", "_dequant_int4_kernel",
                       "_dequant_tinygemm_kernel"}
    assert {dict(launch.constexprs)["TILES"] for launch in launches
            if launch.kernel == "_dequant_tinygemm_kernel"} == {2, 4, 8}
    quant = [dict(launch.constexprs) | {"ptrs": {t for _, t in launch.signature}}
             for launch in launches if launch.kernel == "_quant_linear_kernel"]
    assert {q["BITS"] for q in quant} == {4, 8} and {q["IEEE"] for q in quant} == {False, True}
    assert {q["BLOCK_M"] for q in quant} == {16, 32, 64}  # decode rows up to 64, then prefill
    assert {q["BLOCK_N"] for q in quant} >= {64, 128, 256} and all("num_warps" in q for q in quant)
    assert any("*fp32" in q["ptrs"] and "*bf16" in q["ptrs"] for q in quant)  # split partials


def test_guard_messages_name_what_works(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"--block-size 1, 2, 4, 8, 16, 32, 64, 128"):
        check_triton_support(12, torch.bfloat16, (9, 0))
    check_triton_support(8, torch.bfloat16, (9, 0))  # a tile spans several small blocks
    with pytest.raises(ValueError, match="fp8_e5m2"):
        check_triton_support(16, torch.float8_e4m3fn, (8, 0))
    check_triton_support(16, torch.float8_e4m3fn, (8, 9))
    check_triton_support(16, torch.float8_e4m3fn, None)  # the CPU interpreter
    # The selector asks the GPU and refuses before it builds (or imports) the Triton backend.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="sm_80"):
        get_attention_backend("auto", torch.device("cuda"), 16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="--attention-backend torch"):
        get_attention_backend("triton", torch.device("cuda"), 12, torch.bfloat16)
    assert type(get_attention_backend("torch", torch.device("cuda"), 4)).__name__ == \
        "TorchAttentionBackend"
