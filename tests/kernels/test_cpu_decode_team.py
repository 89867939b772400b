"""DecoderStack's decode step in one parallel region (kernels/cpu/step/decode_team.cpp) against its
op-by-op path: the same kernels, split by thread number and met at barriers instead of one
OpenMP region each (past 8 rows with the rows' elementwise work split too), must give the same hidden states and the same cache, bit for bit, in float32
and (on a CPU with AVX512-BF16, where the build's decode attention reads a bf16 cache) in
bfloat16."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.quantization import tiles
from tests.support.cpu_ops import require_cpu_ops

OPS = require_cpu_ops()

HIDDEN, HEADS, KV_HEADS, DIM, INTER, BLOCK = 256, 4, 2, 64, 384, 16
# The dtypes the team step computes in on this machine's build.
DTYPES = [torch.float32, torch.bfloat16]


def int4_linear(out: int, inp: int, gen: torch.Generator) -> list[torch.Tensor | None]:
    codes = torch.randint(0, 16, (out, inp), generator=gen)
    scales = torch.rand(out, inp // 32, generator=gen) * 0.02 + 0.005
    mins = -8 * scales + torch.randn(out, inp // 32, generator=gen) * 0.01
    qweight, scale_mins = tiles.pack_int4(codes, scales, mins, torch.float16)
    return [qweight, scale_mins, None]


def int8_linear(out: int, inp: int, gen: torch.Generator) -> list[torch.Tensor | None]:
    codes = torch.randint(-127, 128, (out, inp), generator=gen, dtype=torch.int8)
    return [tiles.pack_int8(codes), torch.rand(out, generator=gen) * 0.002 + 0.0005, None]


def dense_linear(out: int, inp: int, gen: torch.Generator) -> list[torch.Tensor | None]:
    return [torch.randn(out, inp, generator=gen) * 0.05, None, None]


def make_stack(layers: int, kinds: list[int], gen: torch.Generator,
               dtype: torch.dtype = torch.float32) -> Any:
    stack = torch.classes.kvserve_cpu.DecoderStack()
    shapes = [((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), (HIDDEN, HEADS * DIM),
              (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    for _ in range(layers):
        linears: list[torch.Tensor | None] = []
        for kind, (out, inp) in zip(kinds, shapes, strict=True):
            linears += {0: dense_linear, 4: int4_linear, 5: int8_linear}[kind](out, inp, gen)
        stack.add_layer((1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
                        (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype), 1e-5, kinds,
                        [32, 0, 32, 0], linears, [HEADS, KV_HEADS, DIM], DIM ** -0.5, 1.0, 1.0)
    return stack


def step(stack: Any, layers: int, contexts: list[int], window: int, team: bool,
         gen_seed: int, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One decode step of len(contexts) rows (row i at position contexts[i] - 1) over fresh
    random caches; the hidden states and every layer's K and V caches afterwards."""
    gen = torch.Generator().manual_seed(gen_seed)
    rows = len(contexts)
    per_seq = -(-max(contexts) // BLOCK)
    blocks = rows * per_seq
    k_caches = [torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
                for _ in range(layers)]
    v_caches = [torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
                for _ in range(layers)]
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(rows, per_seq)
    lens = torch.tensor(contexts, dtype=torch.int32)
    pos = lens.long() - 1
    slots = tables.long().gather(1, (pos // BLOCK).view(-1, 1)).view(-1) * BLOCK + pos % BLOCK
    angle = pos.view(-1, 1, 1).float() * torch.rand(1, 1, DIM // 2, generator=gen)
    cos, sin = angle.cos().repeat(1, 1, 2).to(dtype), angle.sin().repeat(1, 1, 2).to(dtype)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    stack.set_team(team)
    stack.forward(x, cos, sin, k_caches, v_caches, slots, tables, lens, window, None)
    return x, k_caches + v_caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("contexts, window, kinds", [
    ([37], 0, [4, 4, 4, 4]),
    ([37, 5, 70], 0, [5, 4, 5, 4]),       # several rows, int8 and int4 tiles
    ([1500], 0, [4, 4, 4, 4]),           # one long context: its keys split over the threads
    ([1500, 900], 300, [4, 5, 4, 5]),    # a sliding window
    ([20] * 8, 0, [5, 5, 5, 5]),         # the most rows each thread copies (kTeamRows)
    ([20] * 9, 0, [4, 4, 4, 4]),         # past it: the rows split over the threads
    ([3 + 7 * i for i in range(37)], 40, [4, 5, 4, 4]),  # an odd count, a window
    ([33 + i % 5 for i in range(64)], 0, [4, 4, 4, 4]),  # a 64-sequence decode step
])
def test_team_step_equals_op_by_op(contexts: list[int], window: int, kinds: list[int],
                                   threads: int, dtype: torch.dtype) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stack = make_stack(3, kinds, torch.Generator().manual_seed(7), dtype)
        x_ops, caches_ops = step(stack, 3, contexts, window, team=False, gen_seed=11, dtype=dtype)
        assert stack.team_steps() == 0
        x_team, caches_team = step(stack, 3, contexts, window, team=True, gen_seed=11,
                                   dtype=dtype)
        assert stack.team_steps() == 1  # the team path ran
    finally:
        torch.set_num_threads(before)
    assert x_ops.dtype == dtype and torch.isfinite(x_ops).all() and x_ops.abs().max() > 0
    torch.testing.assert_close(x_team, x_ops, atol=0, rtol=0)
    for team_cache, ops_cache in zip(caches_team, caches_ops, strict=True):
        torch.testing.assert_close(team_cache, ops_cache, atol=0, rtol=0)


def test_what_the_team_path_does_not_take_runs_op_by_op() -> None:
    """More rows than it takes, a dense linear or float16 run op by op; input the layers do not fit
    gets the op-by-op path's error, not a read past a buffer."""
    stack = make_stack(2, [4, 4, 4, 4], torch.Generator().manual_seed(3))
    step(stack, 2, [9] * 257, 0, team=True, gen_seed=1)  # past kTeamMaxRows
    assert stack.team_steps() == 0
    step(stack, 2, [9] * 256, 0, team=True, gen_seed=1)
    assert stack.team_steps() == 1
    dense = make_stack(2, [4, 4, 4, 0], torch.Generator().manual_seed(3))
    x, _ = step(dense, 2, [9], 0, team=True, gen_seed=1)
    assert dense.team_steps() == 0 and torch.isfinite(x).all()
    half = make_stack(2, [4, 4, 4, 4], torch.Generator().manual_seed(3), torch.float16)
    x, _ = step(half, 2, [9], 0, team=True, gen_seed=1, dtype=torch.float16)
    assert half.team_steps() == 0 and torch.isfinite(x).all()  # float16: not a team dtype
    for rows in (1, 9):
        with pytest.raises(RuntimeError):
            step(stack, 2, [9] * rows, 0, team=True, gen_seed=1, hidden=HIDDEN + 32)
    assert stack.team_steps() == 1
