"""Input and output processing on their own, with the tiny tokenizer and hand-made requests:
typed refusals naming the parameter; delta-only streaming outputs against one whole output;
stop strings ending a request through the scheduler's hook; logprob texts filled once."""

from __future__ import annotations

from typing import Any

import pytest

from engine.core.request import Request, RequestStatus
from engine.errors import InvalidRequestError
from engine.input_processor import InputProcessor
from engine.output_processor import OutputProcessor
from engine.outputs import Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.support.tiny_models import train_tokenizer

TOKENIZER = train_tokenizer()
VOCAB = len(TOKENIZER)


def processor(num_blocks: int = 64) -> InputProcessor:
    return InputProcessor(TOKENIZER, VOCAB, max_model_len=64, block_size=16,
                          num_blocks=num_blocks, eos_token_ids=frozenset({0}))


@pytest.mark.parametrize("prompt, params, param", [
    ("", SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ([VOCAB], SamplingParams(), "prompt"),
    ({"text": "x"}, SamplingParams(), "prompt"),
    (list(range(3, 67)), SamplingParams(), "prompt"),  # 64 tokens: no room left to generate
    ([5, 6], SamplingParams(max_tokens=63), "max_tokens"),  # 2 + 63 > 64
    ({"prompt_token_ids": [5], "cache_salt": ""}, SamplingParams(), "cache_salt"),
])
def test_refusals_are_typed_and_name_the_parameter(prompt: Any, params: SamplingParams,
                                                   param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        processor().process("r", prompt, params)
    assert info.value.param == param


def test_a_request_the_cache_can_never_hold_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        processor(num_blocks=2).process("r", [5] * 20, SamplingParams(max_tokens=20))
    assert info.value.param == "max_tokens" and "2 blocks" in str(info.value)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"logprobs": 99}, "logprobs"),
    ({"min_tokens": 9, "max_tokens": 2}, "min_tokens")])
def test_sampling_params_refusals_name_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_n_fans_out_into_choices_with_distinct_seeds() -> None:
    parent = processor().process("r", "hello there", SamplingParams(n=3, seed=7, max_tokens=4))
    assert [c.request_id for c in parent.choices] == ["r-0", "r-1", "r-2"]
    assert len({c.sampling_params.seed for c in parent.choices}) == 3
    assert all(c.prompt_token_ids == parent.prompt_token_ids for c in parent.choices)
    assert [c.parent for c in parent.choices] == [None, parent.choices[0], parent.choices[0]]


def feed(kind: RequestOutputKind, text: str, params: dict[str, Any]
         ) -> tuple[list[RequestOutput], Request, list[Request]]:
    """Runs `text`'s tokens one step at a time through an OutputProcessor."""
    finished: list[Request] = []

    def finish(request: Request) -> None:
        request.status = RequestStatus.FINISHED_STOPPED
        finished.append(request)

    out = OutputProcessor(TOKENIZER, finish)
    parent = processor().process("r", [5, 6, 7], SamplingParams(output_kind=kind, **params))
    out.add_request(parent)
    request = parent.choices[0]
    request.status = RequestStatus.RUNNING
    outputs: list[RequestOutput] = []
    for token in TOKENIZER.encode(text):
        if request.is_finished:
            break
        request.append_output_token(token)
        if params.get("logprobs") is not None:
            request.logprobs.append({token: Logprob(-0.5, 1)})
        if request.num_output_tokens == request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
        outputs += out.process([request], now=float(request.num_output_tokens))
    return outputs, request, finished


def test_delta_outputs_concatenate_to_the_final_output() -> None:
    text = "the quick brown fox jumps over the lazy dog"
    num = len(TOKENIZER.encode(text))
    deltas, request, _ = feed(RequestOutputKind.DELTA, text, {"max_tokens": num})
    (final,), _, _ = feed(RequestOutputKind.FINAL_ONLY, text, {"max_tokens": num})
    assert len(deltas) == num and deltas[-1].finished and not any(d.finished
                                                                   for d in deltas[:-1])
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)  # never the history
    assert "".join(d.outputs[0].text for d in deltas) == final.outputs[0].text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.outputs[0].token_ids
    assert final.outputs[0].finish_reason == "length"


def test_a_stop_string_ends_the_request_through_the_scheduler_hook() -> None:
    deltas, request, finished = feed(RequestOutputKind.DELTA, "one two three four five",
                                     {"max_tokens": 32, "stop": ["three"]})
    assert finished == [request] and request.stop_reason == "three"
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "stop"
    assert "".join(d.outputs[0].text for d in deltas) == "one two "


def test_logprob_texts_are_filled_once_and_reach_both_kinds() -> None:
    for kind in RequestOutputKind:
        outputs, request, _ = feed(kind, "hello world", {"max_tokens": 2, "logprobs": 0})
        entries = [e for o in outputs for e in (o.outputs[0].logprobs or [])]
        assert len(entries) == 2
        for token, entry in zip(request.output_token_ids, entries, strict=True):
            assert entry[token].decoded_token == TOKENIZER.decode([token])
        assert entries[0] is request.logprobs[0]  # the sampler's object, not a copy


def _stream(tokenizer: Any, ids: list[int], params: SamplingParams, additive: bool
            ) -> list[tuple[str | None, str]]:
    from engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, [5, 6, 7], params)
    detok.additive = additive
    steps = []
    for token in ids:
        stop = detok.update(token)
        steps.append((stop, detok.take_delta(stop is not None)))
        if stop is not None:
            break
    return steps


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
@pytest.mark.parametrize("skip, stop", [(True, []), (False, []), (True, ["e ", "\n"])])
def test_byte_level_deltas_equal_the_pair_decodes(which: str, skip: bool,
                                                  stop: list[str]) -> None:
    """Byte-level tokenizers take each token's own text as its delta once the last one's was
    complete: on random id streams (byte tokens that split UTF-8 sequences, special tokens)
    every step's delta and stop equal those of decoding the pair, as before the shortcut."""
    import random

    from engine.detokenizer import IncrementalDetokenizer
    from engine.model_loader.loader import load_tokenizer, resolve_model

    tokenizer = TOKENIZER if which == "tiny" else load_tokenizer(resolve_model(None), None)
    params = SamplingParams(skip_special_tokens=skip, stop=stop)
    assert IncrementalDetokenizer(tokenizer, [5], params).additive
    rng = random.Random(7)
    vocab = len(tokenizer)
    for _ in range(40):
        ids = [rng.randrange(vocab) if rng.random() < 0.7 else rng.randrange(300)
               for _ in range(120)]
        assert _stream(tokenizer, ids, params, True) == _stream(tokenizer, ids, params, False)
