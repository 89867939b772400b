"""Greedy sampling's argmax op (kernels/cpu/sampling/sampling.cpp) against torch.argmax, and the
sampler taking it."""

from __future__ import annotations

import pytest
import torch

from tests.support.cpu_ops import require_cpu_ops

OPS = require_cpu_ops()


def test_argmax_rows_equals_torch_argmax() -> None:
    """The greedy argmax op against torch.argmax: ties go to the first index (also across
    -0.0 / +0.0), a NaN wins (the first one), all -inf rows give 0, row lengths off the
    16-lane vectors, strided rows, and a NaN only in the scalar tail."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n in (1, 15, 16, 17, 49152, 49157):
        x = torch.randn(5, n, generator=gen)
        x[1, n // 2:] = x[1].max() + 1.0  # a tie between many: the first of them
        x[2] = float("-inf")
        x[3, n // 3] = float("nan")
        x[4, -1] = float("nan")  # the scalar tail (or the last vector) holds the NaN
        cases.append(x)
    signed_zero = torch.full((1, 40), -1.0)
    signed_zero[0, 20], signed_zero[0, 5] = 0.0, -0.0  # equal: the first (index 5) wins
    cases.append(signed_zero)
    cases.append(torch.randn(6, 96, generator=gen)[:, 8:72])  # rows 96 apart, 64 long
    for x in cases:
        assert torch.equal(OPS.argmax_rows(x), x.argmax(dim=-1)), x.shape
        for dtype in (torch.bfloat16, torch.float16):  # a model's own head output
            narrow = x.to(dtype)
            assert torch.equal(OPS.argmax_rows(narrow), narrow.float().argmax(dim=-1)), dtype
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be float32, bfloat16"):
        OPS.argmax_rows(torch.randn(2, 8).double())


def test_greedy_sampling_takes_the_argmax_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.worker import sampler

    calls: list[torch.Size] = []

    class Spy:
        def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
            calls.append(logits.shape)
            return OPS.argmax_rows(logits)

    monkeypatch.setattr(sampler.cpu_ops, "loaded", lambda: Spy())
    logits = torch.randn(3, 100)
    assert torch.equal(sampler.argmax_rows(logits), logits.argmax(-1)) and calls == [(3, 100)]
    narrow = logits.bfloat16()
    assert torch.equal(sampler.argmax_rows(narrow), narrow.argmax(-1)) and len(calls) == 2
    wide = logits.double()  # not a dtype the op takes: torch's argmax
    assert torch.equal(sampler.argmax_rows(wide), wide.argmax(-1)) and len(calls) == 2
