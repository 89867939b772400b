"""Sampler arithmetic on hand-made logits: penalties as OpenAI and transformers define them,
top-k / top-p / min-p truncation, min_tokens bans."""

from __future__ import annotations

import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.sampling_params import SamplingParams
from engine.worker.sampler import Sampler, apply_penalties, filter_logits


def row(params: SamplingParams, prompt: tuple[int, ...] = (), output: tuple[int, ...] = (),
        banned: tuple[int, ...] = (), rid: str = "r") -> ScheduledRequest:
    return ScheduledRequest(rid, (0,), 0, (0,), True, params, prompt, output, banned)


def test_frequency_and_presence_penalties_follow_openai() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, row(params, output=(1, 1, 2)))
    # token 1 seen twice: 2 - 2*0.5 - 0.25; token 2 once: 3 - 0.5 - 0.25
    assert torch.allclose(logits, torch.tensor([1.0, 0.75, 2.25, 4.0]))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 5.0])
    apply_penalties(logits, row(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,)))
    assert torch.allclose(logits, torch.tensor([1.0, -4.0, 5.0]))


def test_top_k_top_p_min_p_truncate() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    k = logits.clone()
    filter_logits(k, top_k=2, top_p=1.0, min_p=0.0)
    assert torch.isinf(k[2:]).all() and torch.isfinite(k[:2]).all()
    p = logits.clone()
    filter_logits(p, top_k=-1, top_p=0.7, min_p=0.0)  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert torch.isfinite(p[:2]).all() and torch.isinf(p[2:]).all()
    m = logits.clone()
    filter_logits(m, top_k=-1, top_p=1.0, min_p=0.2)  # keep p >= 0.1
    assert torch.isfinite(m[:3]).all() and torch.isinf(m[3])


def test_banned_ids_are_never_sampled_and_greedy_takes_argmax() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 9.0, 1.0], [0.0, 9.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    tokens, _ = sampler.sample(logits, [row(greedy, rid="a"), row(greedy, banned=(1,), rid="b")])
    assert tokens == [1, 2]


def test_sampling_frequencies_follow_the_distribution() -> None:
    sampler = Sampler(torch.device("cpu"))
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    params = SamplingParams(temperature=1.0)
    tokens, _ = sampler.sample(logits, [row(params, rid=str(i)) for i in range(4000)])
    counts = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def test_greedy_rows_asking_for_more_than_the_argmax_get_it() -> None:
    """Plain greedy rows take the argmax-only path; a greedy row with logprobs, a bias, a
    penalty or a ban beside them still gets its logprobs or its changed logits."""
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([0.0, 9.0, 8.5]).repeat(5, 1)
    plain = SamplingParams(temperature=0.0)
    rows = [row(plain, rid="plain"),
            row(SamplingParams(temperature=0.0, logprobs=1), rid="logprobs"),
            row(SamplingParams(temperature=0.0, logit_bias={2: 5.0}), rid="bias"),
            row(SamplingParams(temperature=0.0, frequency_penalty=2.0), output=(1,), rid="pen"),
            row(plain, banned=(1,), rid="ban")]
    tokens, logprobs = sampler.sample(logits.clone(), rows)
    assert tokens == [1, 1, 2, 2, 2]
    assert logprobs[0] is None and logprobs[1] is not None and 1 in logprobs[1]
    alone, none = sampler.sample(logits[:2].clone(), [rows[0], rows[0]])
    assert alone == [1, 1] and none == [None, None]
