"""Greedy decoding on both sides of every parity test: transformers' `generate` (the oracle,
with top-k logprobs per position) and kvserve's offline `LLM` (generated ids per prompt).

The HF side never touches the network: it loads local checkpoints (the tiny models of
tiny_models.py, or the embedded GGUF) on CPU in eval mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput

# ---- kvserve's side -----------------------------------------------------------------------------


def generated_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams
                  ) -> list[list[int]]:
    """Generates from token-id prompts in one batch; returns each first choice's token ids."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def tokens_and_logprobs(outs: list[RequestOutput]
                         ) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each output's token ids and, per position, {token id: logprob}."""
    result = []
    for out in outs:
        c = out.outputs[0]
        assert c.logprobs is not None
        result.append((list(c.token_ids),
                       [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]))
    return result


def logprob_agreement(ref: list[tuple[list[int], list[dict[int, float]]]],
             got: list[tuple[list[int], list[dict[int, float]]]]
             ) -> tuple[float, float, bool]:
    """Prefix agreement, mean |logprob difference| of the chosen token over the common prefix,
    and whether every first divergence keeps each side's token in the other's top 5."""
    agreed = total = 0
    diffs: list[float] = []
    rule = True
    for (ref_ids, ref_lps), (ids, lps) in zip(ref, got, strict=True):
        n = 0
        while n < len(ref_ids) and ids[n] == ref_ids[n]:
            diffs.append(abs(ref_lps[n][ref_ids[n]] - lps[n][ids[n]]))
            n += 1
        agreed += n
        total += len(ref_ids)
        if n < len(ref_ids):
            rule = rule and ids[n] in ref_lps[n] and ref_ids[n] in lps[n]
    return agreed / total, sum(diffs) / max(len(diffs), 1), rule


# ---- transformers' side -------------------------------------------------------------------------


def load_hf_model(
    model_dir_or_model: str | Path | PreTrainedModel,
    dtype: torch.dtype = torch.float32,
    **from_pretrained_kwargs: Any,
) -> PreTrainedModel:
    """Loads a local checkpoint on CPU in eval mode (offline), or passes a loaded model through."""
    if isinstance(model_dir_or_model, PreTrainedModel):
        return model_dir_or_model.eval()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir_or_model, dtype=dtype, local_files_only=True, **from_pretrained_kwargs)
    return model.eval()


class GreedyTrace(NamedTuple):
    """One prompt's greedy continuation and, per generated position, the k best candidates."""

    token_ids: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]

    def top2_gaps(self) -> list[float]:
        """Per generated position, HF's top-1 minus top-2 logprob (needs k >= 2)."""
        return [row[0] - row[1] for row in self.topk_logprobs]


def _eos_ids(model: PreTrainedModel) -> set[int]:
    """The eos ids generate stops on, from the model's generation config."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def _truncate_after_eos(token_ids: list[int], eos_ids: set[int]) -> list[int]:
    """Keeps tokens up to and including the first eos (generate pads after it)."""
    for i, token_id in enumerate(token_ids):
        if token_id in eos_ids:
            return token_ids[: i + 1]
    return token_ids


@torch.no_grad()
def _generate_one(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> Any:
    """Runs transformers' greedy `generate` for one unpadded prompt, keeping the raw logits."""
    input_ids = torch.tensor([prompt], dtype=torch.long)  # [1, prompt_len]
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = next(iter(_eos_ids(model)), 0)
    # transformers' annotations make mypy see `generate` as a Tensor; the call itself is fine.
    return cast(Any, model).generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
        do_sample=False, num_beams=1, pad_token_id=pad_id, return_dict_in_generate=True,
        output_logits=True, temperature=None, top_p=None, top_k=None)


def hf_topk_greedy(
    model_dir_or_model: str | Path | PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int = 5,
    **from_pretrained_kwargs: Any,
) -> list[GreedyTrace]:
    """Greedy `generate` per prompt, with the top-k ids and logprobs at each generated position.

    Extra kwargs go to `from_pretrained` (e.g. `gguf_file=...`, `dtype=torch.bfloat16`).
    """
    model = load_hf_model(model_dir_or_model, **from_pretrained_kwargs)
    eos_ids = _eos_ids(model)
    traces = []
    for prompt in prompts:
        out = _generate_one(model, prompt, max_new_tokens)
        token_ids = _truncate_after_eos(out.sequences[0, len(prompt):].tolist(), eos_ids)
        logits = torch.cat(out.logits[: len(token_ids)]).float()  # [num_generated, vocab]
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        traces.append(GreedyTrace(token_ids, top.indices.tolist(), top.values.tolist()))
    return traces


def hf_greedy(
    model_dir_or_model: str | Path | PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """Greedy `generate` one prompt at a time; returns only generated ids (eos kept if hit)."""
    traces = hf_topk_greedy(model_dir_or_model, prompts, max_new_tokens, k=1, dtype=dtype)
    return [trace.token_ids for trace in traces]


@torch.no_grad()
def hf_logprobs(
    model_dir_or_model: str | Path | PreTrainedModel, sequences: list[list[int]]
) -> list[torch.Tensor]:
    """Per sequence, float32 log_softmax of the logits at every position: [seq_len, vocab]."""
    model = load_hf_model(model_dir_or_model)
    results = []
    for sequence in sequences:
        logits = model(torch.tensor([sequence], dtype=torch.long)).logits[0]  # [seq_len, vocab]
        results.append(torch.log_softmax(logits.float(), dim=-1))
    return results


def count_one_call_steps(monkeypatch: Any) -> list[bool]:
    """Records, per call of FusedStack.decode_logits (the one-call decode step), whether it
    served the step (True) or returned None for the old path."""
    from engine.models.cpu_layer import FusedStack

    taken: list[bool] = []
    call = FusedStack.decode_logits

    def counted(self: FusedStack, *args: Any, **kwargs: Any) -> Any:
        logits = call(self, *args, **kwargs)
        taken.append(logits is not None)
        return logits

    monkeypatch.setattr(FusedStack, "decode_logits", counted)
    return taken
