"""DecoderStack.forward_logits (kernels/cpu/step/decode_team.cpp): a decode step from token ids to
logits in one parallel region (the tied int8 embedding, every layer, the final norm, the LM
head) against the same step op by op: q8_embedding, forward without the team, rms_norm,
q8_linear. The logits and every cache must be equal bit for bit, in float32 and bfloat16 (a
bfloat16 head's output widened to float32, as compute_logits widens it); forward_argmax's tokens
are torch.argmax of those logits (ties to the first index across the threads' shares of the
head); what the step does not take returns None having changed nothing; bad ids or positions
get an error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.quantization import tiles
from tests.kernels.test_cpu_decode_team import (
    BLOCK,
    DIM,
    DTYPES,
    HIDDEN,
    KV_HEADS,
    OPS,
    make_stack,
)

VOCAB, MAX_POS, EPS = 336, 2048, 1e-5


def ends(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    codes = torch.randint(-127, 128, (VOCAB, HIDDEN), generator=gen, dtype=torch.int8)
    angle = torch.arange(MAX_POS).view(-1, 1).float() * torch.rand(1, DIM // 2, generator=gen)
    return {"cos": angle.cos().repeat(1, 2), "sin": angle.sin().repeat(1, 2),
            "norm": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
            "qweight": tiles.pack_int8(codes), "scales": torch.rand(VOCAB, generator=gen) * 0.01}


def inputs(layers: int, contexts: list[int], seed: int, dtype: torch.dtype = torch.float32
           ) -> dict[str, Any]:
    """Token ids, positions and fresh random caches for rows at positions contexts[i] - 1."""
    gen = torch.Generator().manual_seed(seed)
    rows, per_seq = len(contexts), -(-max(contexts) // BLOCK)
    blocks = rows * per_seq
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(rows, per_seq)
    lens = torch.tensor(contexts, dtype=torch.int32)
    pos = lens.long() - 1
    return {
        "ids": torch.randint(0, VOCAB, (rows,), generator=gen), "pos": pos,
        "k": [torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
              for _ in range(layers)],
        "v": [torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
              for _ in range(layers)],
        "slots": tables.long().gather(1, (pos // BLOCK).view(-1, 1)).view(-1) * BLOCK
        + pos % BLOCK, "tables": tables, "lens": lens}


def by_ops(stack: Any, e: dict[str, Any], i: dict[str, Any], window: int) -> torch.Tensor:
    """The same step through the separate ops (LlamaForCausalLM's forward + compute_logits)."""
    dtype = e["norm"].dtype
    x = OPS.q8_embedding(i["ids"], e["qweight"], e["scales"], dtype)
    cos = e["cos"][i["pos"]].unsqueeze(1).to(dtype)
    sin = e["sin"][i["pos"]].unsqueeze(1).to(dtype)
    stack.set_team(False)
    stack.forward(x, cos, sin, i["k"], i["v"], i["slots"], i["tables"], i["lens"], window, None)
    stack.set_team(True)
    return OPS.q8_linear(OPS.rms_norm(x, e["norm"], EPS), e["qweight"], e["scales"]).float()


def rows_of(i: dict[str, Any]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The step's rows as the C++ step takes them (the model runner's lists): ids, positions,
    slots and the block tables' rows one after another."""
    return (i["ids"].tolist(), i["pos"].tolist(), i["slots"].tolist(),
            i["tables"].flatten().tolist())


def in_one(stack: Any, i: dict[str, Any], window: int) -> torch.Tensor | None:
    ids, pos, slots, tables = rows_of(i)
    out: torch.Tensor | None = stack.forward_logits(ids, pos, i["k"], i["v"], slots, tables,
                                                    window)
    return out


def with_ends(kinds: list[int], e: dict[str, Any], layers: int = 3) -> Any:
    stack = make_stack(layers, kinds, torch.Generator().manual_seed(7), e["norm"].dtype)
    stack.set_ends(e["cos"], e["sin"], e["norm"], EPS, e["qweight"], e["scales"])
    return stack


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("contexts, window, kinds", [
    ([37], 0, [4, 4, 4, 4]),
    ([37, 5, 70], 0, [5, 4, 5, 4]),
    ([1500, 900], 300, [4, 5, 4, 5]),    # a long context split over the threads, a window
    ([20] * 8, 0, [5, 5, 5, 5]),
    ([3 + 7 * i for i in range(37)], 40, [4, 5, 4, 4]),  # the rows split over the threads
])
def test_logits_in_one_region_equal_the_ops(contexts: list[int], window: int, kinds: list[int],
                                            threads: int, dtype: torch.dtype) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        e = ends(torch.Generator().manual_seed(5), dtype)
        stack = with_ends(kinds, e)
        ops_in, one_in = inputs(3, contexts, 11, dtype), inputs(3, contexts, 11, dtype)
        expected = by_ops(stack, e, ops_in, window)
        got = in_one(stack, one_in, window)
        assert stack.team_steps() == 1
    finally:
        torch.set_num_threads(before)
    assert got is not None and got.shape == (len(contexts), VOCAB) and got.dtype == torch.float32
    assert torch.isfinite(expected).all() and expected.abs().max() > 0
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    for name in ("k", "v"):
        for a, b in zip(one_in[name], ops_in[name], strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("contexts, tied", [([37], False), ([37, 5, 70], False),
                                            ([20] * 8, False), ([37, 5], True),
                                            ([20] * 64, False), ([20] * 13, True)])
def test_argmax_in_one_region_is_the_argmax_of_the_logits(contexts: list[int], tied: bool,
                                                          threads: int,
                                                          dtype: torch.dtype) -> None:
    """forward_argmax: each row's torch.argmax of forward_logits' logits, the caches written
    alike. `tied`: every head row the same, so that each thread's share holds the row's
    maximum and the first index (thread 0's) must win."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        e = ends(torch.Generator().manual_seed(5), dtype)
        if tied:
            codes = torch.randint(-127, 128, (1, HIDDEN), generator=torch.Generator()
                                  .manual_seed(3), dtype=torch.int8).repeat(VOCAB, 1)
            e["qweight"], e["scales"] = tiles.pack_int8(codes), torch.full((VOCAB,), 0.01)
        stack = with_ends([4, 5, 4, 5], e)
        by_logits, by_argmax = inputs(3, contexts, 11, dtype), inputs(3, contexts, 11, dtype)
        logits = in_one(stack, by_logits, 0)
        ids, pos, slots, tables = rows_of(by_argmax)
        tokens = stack.forward_argmax(ids, pos, by_argmax["k"], by_argmax["v"], slots, tables,
                                      0)
        assert stack.team_steps() == 2
    finally:
        torch.set_num_threads(before)
    assert logits is not None and tokens is not None and tokens.dtype == torch.long
    assert torch.equal(tokens, logits.argmax(dim=-1))
    if tied:
        assert tokens.tolist() == [0] * len(contexts)
    for name in ("k", "v"):
        for a, b in zip(by_argmax[name], by_logits[name], strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_what_it_does_not_take_returns_none_untouched() -> None:
    """No ends, more rows than the team step takes (256), or a dense layer: None, caches as they
    were."""
    e = ends(torch.Generator().manual_seed(5))
    bare = make_stack(2, [4, 4, 4, 4], torch.Generator().manual_seed(7))
    cases = [(bare, [9]), (with_ends([4, 4, 4, 4], e, 2), [9] * 257),
             (with_ends([4, 4, 4, 0], e, 2), [9])]
    for stack, contexts in cases:
        i, fresh = inputs(2, contexts, 3), inputs(2, contexts, 3)
        assert in_one(stack, i, 0) is None
        assert stack.team_steps() == 0
        for a, b in zip(i["k"] + i["v"], fresh["k"] + fresh["v"], strict=True):
            assert torch.equal(a, b)


def test_a_head_that_does_not_fit_is_not_taken() -> None:
    """An LM head whose rows are not the hidden size: None (the model's own path then
    raises), not a read past the head's codes."""
    e = ends(torch.Generator().manual_seed(5))
    e["qweight"] = tiles.pack_int8(torch.zeros(VOCAB, HIDDEN + 32, dtype=torch.int8))
    assert in_one(with_ends([4, 4, 4, 4], e, 2), inputs(2, [9], 3), 0) is None


@pytest.mark.parametrize("field, value, match", [
    ("pos", MAX_POS, "rotary table"),
    ("ids", VOCAB, "out of range"),
])
def test_bad_ids_or_positions_raise(field: str, value: int, match: str) -> None:
    e = ends(torch.Generator().manual_seed(5))
    stack = with_ends([4, 4, 4, 4], e, 2)
    i = inputs(2, [9], 3)
    i[field] = torch.tensor([value])
    with pytest.raises(RuntimeError, match=match):
        in_one(stack, i, 0)
    assert stack.team_steps() == 0


@pytest.mark.parametrize("cut", ["pos", "slots", "tables"])
def test_rows_that_do_not_line_up_raise(cut: str) -> None:
    """Lists of another length than the ids (or a block table that is not whole rows): an
    error naming the counts, nothing run."""
    stack = with_ends([4, 4, 4, 4], ends(torch.Generator().manual_seed(5)), 2)
    i = inputs(2, [9, 20], 3)
    ids, pos, slots, tables = rows_of(i)
    args = {"pos": pos, "slots": slots, "tables": tables}
    args[cut] = args[cut][:-1]
    stack.set_team(True)
    with pytest.raises(RuntimeError, match="2 ids"):
        stack.forward_logits(ids, args["pos"], i["k"], i["v"], args["slots"], args["tables"], 0)
    assert stack.team_steps() == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_decode_steps_run_in_one_call_with_the_same_results(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """The embedded SmolLM2 GGUF in float32 and bfloat16 (Q4 layers in place, the tied int8
    head): its decode steps go through forward_logits, and greedy tokens with logprobs are those
    of the same engine with that call switched off (embedding, layers, norm and head called
    apart). bfloat16 where the build's decode attention reads a bf16 cache (AVX512-BF16)."""
    from engine import LLM, SamplingParams
    from engine.models.llama import LlamaForCausalLM
    from tests.support.greedy import count_one_call_steps, tokens_and_logprobs

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    prompts = ["The capital of France is", "Water boils at", "One, two, three,"]
    taken = count_one_call_steps(monkeypatch)
    llm = LLM(None, dtype=str(dtype).removeprefix("torch."), max_model_len=256, num_threads=2)
    try:
        whole = tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
        assert sum(taken) >= 15  # every decode step of the batch of three
        # Greedy without logprobs: the step returns the tokens (forward_argmax)
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        taken.clear()
        argmax = [list(o.outputs[0].token_ids)
                  for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert sum(taken) >= 15
        stack = llm.engine.runner.model._fused_stack
        steps = stack.stack.team_steps()
        monkeypatch.setattr(LlamaForCausalLM, "decode_logits", lambda *a, **k: None)
        apart = tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
        assert stack.stack.team_steps() >= steps + 15  # the layers alone, still as a team
    finally:
        llm.engine.shutdown()
    assert whole == apart
    assert argmax == [tokens for tokens, _ in whole]
