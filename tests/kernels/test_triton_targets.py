"""The startup guards against what the Triton kernels cannot run, checked against the compiler
itself: the attention kernel is compiled ahead of time for real GPU targets (Triton's own ptxas,
no GPU needed), and the guard must refuse exactly the configurations that fail to compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.selector import TRITON_BLOCK_SIZES, check_triton_support, get_attention_backend

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]
CASES = [(torch.bfloat16, 16, 80), (torch.bfloat16, 8, 90), (torch.bfloat16, 128, 90),
         (torch.float8_e4m3fn, 16, 80), (torch.float8_e4m3fn, 16, 89),
         (torch.float8_e4m3fn, 32, 90), (torch.float8_e5m2, 16, 80)]

# Triton's names for the element types of the kernel's pointers.
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
INT_ARGS = ("num_seqs", "window", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
            "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
            "stride_bt")


def compile_attention(kv_dtype: torch.dtype, block_size: int, arch: int) -> None:
    """Compiles the decode specialization a bfloat16 model with 32 query and 8 KV heads of 128
    would launch; raises what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_attention

    q, kv = "bf16", TRITON_TYPES[kv_dtype]
    signature: dict[str, str] = {
        "out_ptr": f"*{q}", "q_ptr": f"*{q}", "k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}",
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
        "seg_acc_ptr": "*fp32", "seg_max_ptr": "*fp32", "seg_sum_ptr": "*fp32",
        "qk_scale": "fp32", "v_scale": "fp32", **dict.fromkeys(INT_ARGS, "i32")}
    constants: dict[str, Any] = {
        "NUM_HEADS": 32, "GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "HEAD_PAD": 128,
        "BLOCK_SIZE": block_size, "BLOCK_Q": 4, "NUM_SEGMENTS": 1, "SLIDING": False,
        "COMPUTE_F32": False, "PRECISION": "tf32"}
    signature.update(dict.fromkeys(constants, "constexpr"))
    names = list(signature)
    source = ASTSource(triton_attention._attention_kernel, signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=GPUTarget("cuda", arch, 32))


def compiles(kv_dtype: torch.dtype, block_size: int, arch: int) -> bool:
    try:
        compile_attention(kv_dtype, block_size, arch)
    except Exception:  # Triton raises CompilationError or a backend error, by version
        return False
    return True


def guard_allows(kv_dtype: torch.dtype, block_size: int, arch: int) -> bool:
    try:
        check_triton_support(block_size, kv_dtype, divmod(arch, 10))
    except ValueError:
        return False
    return True


def compile_cases() -> None:
    """Prints, as JSON, whether each case compiles (run in a fresh process: the kernel tests
    switch this one's Triton to its CPU interpreter, which compiles nothing)."""
    print(json.dumps([compiles(*case) for case in CASES]))


@pytest.fixture(scope="module")
def compiled() -> list[bool]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.kernels.test_triton_targets import compile_cases; compile_cases()"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_guard_refuses_exactly_what_fails_to_compile(compiled: list[bool]) -> None:
    assert compiled.count(True) >= 4  # the compiler really ran: the allowed cases compile
    for case, ok in zip(CASES, compiled, strict=True):
        assert guard_allows(*case) == ok, case


def test_guard_messages_name_what_works(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"--block-size 16, 32, 64, 128"):
        check_triton_support(8, torch.bfloat16, (9, 0))
    with pytest.raises(ValueError, match="fp8_e5m2"):
        check_triton_support(16, torch.float8_e4m3fn, (8, 0))
    check_triton_support(16, torch.float8_e4m3fn, (8, 9))
    check_triton_support(16, torch.float8_e4m3fn, None)  # the CPU interpreter
    assert TRITON_BLOCK_SIZES == (16, 32, 64, 128)
    # The selector asks the GPU and refuses before it builds (or imports) the Triton backend.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="sm_80"):
        get_attention_backend("auto", torch.device("cuda"), 16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="--attention-backend torch"):
        get_attention_backend("triton", torch.device("cuda"), 4, torch.bfloat16)
    assert type(get_attention_backend("torch", torch.device("cuda"), 4)).__name__ == \
        "TorchAttentionBackend"
