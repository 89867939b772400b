"""Structured outputs and logit_bias through the offline API: grammar-constrained decoding with
xgrammar on the tiny random Llama (whose free text is noise, so every valid output is the
grammar's doing), mixed batches, n > 1, preemption, chunked prefill, the compile cache, input
validation, and one SmolLM2 run (slow)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.core.request import RequestStatus
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import constraint_key
from loadtest.benchmarks.structured_output import PERSON

# Strings carry a pattern: xgrammar 0.2.9 lets a string with minLength/maxLength hold raw
# control characters (invalid JSON), and a free string on a random model rarely closes.
NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3}},
     "required": ["colour", "ok", "tags"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "address": {"type": "object", "properties": {"city": NAME,
                                                         "zip": {"type": "string",
                                                                 "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]}},
                 "required": ["id", "address"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "maxItems": 4}},
     "required": ["user", "scores"]},
]
PROMPTS = ["Hello there", "the cat sees a dog", "One two three", "My friend writes"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_threads=1,
               kv_cache_memory_bytes=8 * 2**20)


def constrained(**fields: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**fields)


def test_mixed_batch_leaves_unconstrained_rows_alone_and_validates_every_schema(llm: LLM
                                                                                 ) -> None:
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True,
                            top_p=0.9)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    json_params = [SamplingParams(temperature=0.8, seed=s, max_tokens=200,
                                  structured_outputs=constrained(json=schema))
                   for s, schema in enumerate(SCHEMAS)]
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:3], plain + json_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == \
        [o.outputs[0].token_ids for o in alone]
    for out, schema in zip(mixed[2:], SCHEMAS, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema_rs.validate(schema, json.loads(out.outputs[0].text))


def test_greedy_and_seeded_runs_of_each_schema_parse_and_validate(llm: LLM) -> None:
    for schema in SCHEMAS:
        params = [SamplingParams(temperature=t, seed=s, max_tokens=200,
                                 structured_outputs=constrained(json=schema))
                  for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (0.7, 3))]
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            assert out.outputs[0].finish_reason == "stop"
            jsonschema_rs.validate(schema, json.loads(out.outputs[0].text))


def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    cases: list[tuple[StructuredOutputsParams, Any]] = [
        (constrained(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (constrained(regex=r"[a-z]{2,5}-[0-9]{3}"),
         lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
        (constrained(choice=("yes", "no", 'say "maybe"')),
         lambda t: t in ("yes", "no", 'say "maybe"')),
        (constrained(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    ]
    for so, check in cases:
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=64, structured_outputs=so)
        if so.json_object:  # free strings on a random model rarely close: bias the closers
            tokenizer = llm.get_tokenizer()
            params.logit_bias = {tokenizer.convert_tokens_to_ids(c): 8.0 for c in '"}'}
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            text = out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop", (so, text)
            assert check(text), (so, text)


def test_n_choices_each_follow_the_grammar_with_their_own_matcher(llm: LLM) -> None:
    regex = r"(cat|dog|bird)( (cat|dog|bird)){0,3}"
    out = llm.generate(PROMPTS[0], SamplingParams(
        n=6, temperature=1.0, seed=11, max_tokens=40,
        structured_outputs=constrained(regex=regex)), use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 6 and all(re.fullmatch(regex, t) for t in texts), texts
    assert len(set(texts)) > 1  # the choices sample apart: no shared matcher state


def test_grammar_end_stops_even_with_ignore_eos_and_min_tokens(llm: LLM) -> None:
    for extra in ({"ignore_eos": True}, {"min_tokens": 10}):
        out = llm.generate(PROMPTS[1], SamplingParams(
            temperature=0.0, max_tokens=50, structured_outputs=constrained(choice=("on", "off")),
            **extra), use_tqdm=False)[0].outputs[0]
        assert out.text in ("on", "off") and out.finish_reason == "stop", (extra, out)


def test_preemption_and_chunked_prefill_keep_outputs_valid_and_unchanged(
        tiny_llama_dir: Path, llm: LLM) -> None:
    # 2 layers x 2 KV heads x head_dim 16 x K and V x 4 bytes = 512 bytes a token: 12 blocks
    # of 16 tokens, for 6 requests that each grow to ~100 tokens, force preemptions; a
    # 16-token budget splits the 40-token prompts into chunks.
    tight = LLM(str(tiny_llama_dir), dtype="float32", num_threads=1, block_size=16,
                kv_cache_memory_bytes=12 * 16 * 512, max_model_len=160,
                max_num_batched_tokens=16, max_num_seqs=6)
    prompt = " ".join(["the cat sees a dog"] * 5)
    schema = SCHEMAS[2]
    params = [SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=i % 2 == 0,
                             structured_outputs=constrained(json=schema) if i % 2 else None)
              for i in range(6)]
    prompts = [f"{prompt} {i}" for i in range(6)]
    pressured = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    calm = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in pressured] == [o.outputs[0].token_ids for o in calm]
    for out in pressured[1::2]:
        jsonschema_rs.validate(schema, json.loads(out.outputs[0].text))


def test_compile_cache_hits_for_the_same_constraint(llm: LLM) -> None:
    manager = llm.engine.structured_output
    schema = {"type": "object", "properties": {"k": {"enum": ["cache", "hit"]}},
              "required": ["k"]}
    before = (manager.stats.hits, manager.stats.misses)
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=constrained(json=schema))
    llm.generate(PROMPTS[0], params, use_tqdm=False)
    llm.generate(PROMPTS[1], params, use_tqdm=False)
    # The same schema as JSON text is the same key.
    llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20,
                 structured_outputs=constrained(json=json.dumps(schema))), use_tqdm=False)
    assert (manager.stats.hits - before[0], manager.stats.misses - before[1]) == (2, 1)
    assert constraint_key(constrained(json=schema)) == \
        constraint_key(constrained(json=json.dumps(schema)))


def test_a_grammar_that_fails_to_compile_ends_only_its_request(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = llm.engine.structured_output

    def broken(key: Any) -> Any:
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(manager, "_compile", broken)
    outs = llm.generate(PROMPTS[:2], [
        SamplingParams(temperature=0.0, max_tokens=8,
                       structured_outputs=constrained(regex="[0-9]{4}-never-cached")),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    assert outs[1].outputs[0].finish_reason == "length"
    assert RequestStatus.FINISHED_ERROR.finished
    assert not llm.engine.has_unfinished_requests()


def test_unconstrained_requests_never_touch_a_bitmask(tiny_llama_dir: Path) -> None:
    fresh = LLM(str(tiny_llama_dir), dtype="float32", num_threads=1,
                kv_cache_memory_bytes=2**20)
    fresh.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    sampler = fresh.engine.runner.sampler
    assert sampler.grammars._bitmask is None and not sampler.grammars.matchers
    assert fresh.engine.structured_output._compiler is None  # no tokenizer info built either


def test_logit_bias_forces_and_bans_tokens(llm: LLM) -> None:
    forced = llm.generate(PROMPTS[0], SamplingParams(
        temperature=1.0, seed=0, max_tokens=6, ignore_eos=True, logit_bias={100: 100.0}),
        use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [100] * 6
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = llm.generate(PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=1, logit_bias={greedy: -100.0}),
        use_tqdm=False)[0].outputs[0].token_ids[0]
    assert banned != greedy


@pytest.mark.parametrize(("params", "param", "words"), [
    ({"structured_outputs": StructuredOutputsParams(json={"type": "nonsense"})},
     "structured_outputs", "Unsupported type"),
    ({"structured_outputs": StructuredOutputsParams(json='{"type": "object"')},
     "structured_outputs", "JSON"),
    ({"structured_outputs": StructuredOutputsParams(regex="a(b")},
     "structured_outputs", "parenthesis"),
    ({"structured_outputs": StructuredOutputsParams(grammar="root ::= undefined_rule")},
     "structured_outputs", "undefined_rule"),
    ({"structured_outputs": StructuredOutputsParams(choice=())}, "structured_outputs",
     "choice"),
    ({"structured_outputs": StructuredOutputsParams(regex="a", grammar='root ::= "a"')},
     "structured_outputs", "exactly one"),
    ({"structured_outputs": StructuredOutputsParams()}, "structured_outputs", "exactly one"),
    ({"logit_bias": {10**6: 1.0}}, "logit_bias", "vocabulary"),
    ({"logit_bias": {5: 101.0}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "token ids"),
])
def test_bad_constraints_are_refused_before_queueing(llm: LLM, params: dict[str, Any],
                                                     param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, **params), use_tqdm=False)
    assert info.value.param == param
    assert words in str(info.value)
    assert not llm.engine.has_unfinished_requests()


NESTED = PERSON  # the benchmark's nested schema (a nested object, an array, a boolean)


@pytest.mark.slow
def test_smollm2_answers_validate_against_a_nested_schema_every_time(model_path: Path) -> None:
    smol = LLM(str(model_path), num_threads=1, max_model_len=1024)
    questions = ["Describe a fictional person as JSON.", "Invent a pianist from Vienna.",
                 "Give me a made-up user profile.", "Tell me about a retired sailor."]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=256,
                             structured_outputs=StructuredOutputsParams(json=NESTED))
              for t, s in ((0.0, None), (0.7, 1), (1.0, 2), (0.7, 3))]
    outs = smol.chat([[{"role": "user", "content": q}] for q in questions], params,
                     use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema_rs.validate(NESTED, json.loads(completion.text))
