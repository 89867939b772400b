"""The OpenAI-compatible server end to end, driven by the official `openai` SDK against a real
`kvserve serve` process on the tiny Llama: greedy output equals transformers `generate`, streamed
text equals whole text, and usage, n, stop strings, logprobs, prompt lists and echo behave as
OpenAI clients expect."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tests.support.api import post_json
from tests.support.greedy import GreedyTrace, hf_topk_greedy, load_hf_model
from tests.support.server_process import ServerProcess
from tests.support.tiny_models import english_sentences

MAX_TOKENS = 12
# Sentences whose greedy continuation ends on a whole character: the streamed text of a choice
# holds back a trailing incomplete UTF-8 sequence, so only then is the text the plain decode.
PROMPTS = english_sentences(4, seed=1)[1:3]
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello!"}]
# A conversation whose greedy continuation reaches eos within MAX_TOKENS.
EOS_CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Where does the old snow model sleep?"}]


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    """The session's default server (tests/conftest.py)."""
    return tiny_server


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> PreTrainedModel:
    return load_hf_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def prompt_ids(server: ServerProcess, **body: Any) -> list[int]:
    """The server's own tokenization of a prompt or of chat messages."""
    ids: list[int] = post_json(server, "/tokenize", body, timeout=30)["tokens"]
    return ids


def hf_trace(hf_model: PreTrainedModel, ids: list[int], max_new_tokens: int = MAX_TOKENS
             ) -> GreedyTrace:
    trace = hf_topk_greedy(hf_model, [ids], max_new_tokens, k=3)[0]
    assert len(trace.token_ids) == max_new_tokens, "the reference hit eos; pick another prompt"
    return trace


def greedy(**extra: Any) -> dict[str, Any]:
    """Fixed-length greedy sampling arguments for the SDK."""
    return {"max_tokens": MAX_TOKENS, "temperature": 0.0,
            "extra_body": {"ignore_eos": True, **extra}}


# ---- greedy parity with transformers ----------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_hf_greedy(client: openai.OpenAI, server: ServerProcess,
                                      model_name: str, hf_model: PreTrainedModel,
                                      tokenizer: PreTrainedTokenizerBase, prompt: str) -> None:
    ids = prompt_ids(server, prompt=prompt)
    trace = hf_trace(hf_model, ids)
    expected_text = str(tokenizer.decode(trace.token_ids))
    assert not expected_text.endswith("\ufffd")
    out = client.completions.create(model=model_name, prompt=prompt, logprobs=1, **greedy())
    choice = out.choices[0]
    assert choice.text == expected_text
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == MAX_TOKENS
    # Token by token: each sampled token's text and logprob are HF's greedy token's.
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in trace.token_ids]
    assert choice.logprobs.token_logprobs is not None
    for got, ref in zip(choice.logprobs.token_logprobs, trace.topk_logprobs, strict=True):
        assert math.isclose(got, ref[0], abs_tol=1e-4)


def test_chat_matches_hf_greedy(client: openai.OpenAI, server: ServerProcess, model_name: str,
                                hf_model: PreTrainedModel,
                                tokenizer: PreTrainedTokenizerBase) -> None:
    ids = prompt_ids(server, messages=CHAT)
    messages = [{"role": str(m["role"]), "content": str(m.get("content"))} for m in CHAT]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    trace = hf_trace(hf_model, ids)
    out = client.chat.completions.create(model=model_name, messages=CHAT,
                                         logprobs=True, top_logprobs=1, **greedy())
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    expected_text = str(tokenizer.decode(trace.token_ids))
    assert not expected_text.endswith("\ufffd")
    assert choice.message.content == expected_text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.token for e in choice.logprobs.content] == \
        [tokenizer.decode([t]) for t in trace.token_ids]
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), MAX_TOKENS)


def test_chat_stops_at_eos_like_hf(client: openai.OpenAI, server: ServerProcess,
                                   model_name: str, hf_model: PreTrainedModel,
                                   tokenizer: PreTrainedTokenizerBase) -> None:
    ids = prompt_ids(server, messages=EOS_CHAT)
    reference = hf_topk_greedy(hf_model, [ids], MAX_TOKENS, k=1)[0].token_ids
    assert len(reference) < MAX_TOKENS and reference[-1] == tokenizer.eos_token_id
    out = client.chat.completions.create(model=model_name, messages=EOS_CHAT,
                                         max_tokens=MAX_TOKENS, temperature=0.0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == tokenizer.decode(reference, skip_special_tokens=True)
    assert out.usage is not None and out.usage.completion_tokens == len(reference)


# ---- streaming --------------------------------------------------------------------------------

def test_streamed_completion_equals_whole(client: openai.OpenAI, model_name: str) -> None:
    whole = client.completions.create(model=model_name, prompt=PROMPTS[0], **greedy())
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[0], stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    content, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    # The usage chunk comes last, without choices; every other chunk has usage null.
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()
    assert usage_chunk.usage.total_tokens == \
        usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    assert all(c.usage is None for c in content)
    # Only the last content chunk carries the finish reason.
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + \
        ["length"]
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_equals_whole(client: openai.OpenAI, model_name: str) -> None:
    whole = client.chat.completions.create(model=model_name, messages=CHAT,
                                           **greedy())
    chunks = list(client.chat.completions.create(
        model=model_name, messages=CHAT, stream=True,
        stream_options={"include_usage": True}, **greedy()))
    content, usage_chunk = chunks[:-1], chunks[-1]
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == \
        whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + \
        ["length"]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_continuous_usage_counts_the_prompt_from_the_first_chunk(client: openai.OpenAI,
                                                                  model_name: str) -> None:
    kwargs: dict[str, Any] = {"model": model_name, "messages": CHAT, "n": 2, "seed": 7,
                              "temperature": 1.0, "max_tokens": 4,
                              "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kwargs)
    # continuous_usage_stats is vLLM's addition to stream_options, unknown to the SDK's types.
    stream_options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(
        stream=True, **{**kwargs, "extra_body": {**kwargs["extra_body"],
                                                 "stream_options": stream_options}}))
    assert whole.usage is not None
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.prompt_tokens for c in chunks if c.usage] == \
        [whole.usage.prompt_tokens] * len(chunks)
    completion = [c.usage.completion_tokens for c in chunks if c.usage]
    assert completion[0] == 0 and completion == sorted(completion)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens == 2 * 4
    assert sorted(c.index for c in chunks[0].choices) == [0, 1]  # one role delta per choice
    assert all(c.delta.role == "assistant" for c in chunks[0].choices)


def test_raw_sse_framing(server: ServerProcess, model_name: str) -> None:
    body = {"model": model_name, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(server.url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""  # every event, the last one included, ends with a blank line
    events = events[:-1]
    assert events[-1] == "data: [DONE]"
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: {") and "\n" not in event, event
        payloads.append(json.loads(event[len("data: "):]))
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5


# ---- sampling options -------------------------------------------------------------------------

def test_n_2_gives_two_seeded_choices(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = {"model": model_name, "prompt": PROMPTS[0], "n": 2,
                              "temperature": 1.0, "seed": 1234, "max_tokens": 8,
                              "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage is not None and first.usage.completion_tokens == 16
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # the two choices sample independently
    again = client.completions.create(**kwargs)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts  # seeded
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == texts


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, model_name: str) -> None:
    full = client.completions.create(model=model_name, prompt=PROMPTS[0], **greedy())
    text = full.choices[0].text
    # A stop string from the middle of the greedy text: two printable ASCII characters.
    start = next(i for i in range(3, len(text) - 1)
                 if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    stop = text[start:start + 2]
    cut = text[:text.index(stop)]
    out = client.completions.create(model=model_name, prompt=PROMPTS[0], stop=[stop],
                                    **greedy())
    choice = out.choices[0]
    assert choice.text == cut
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra["stop_reason"] == stop
    assert out.usage is not None and out.usage.completion_tokens < MAX_TOKENS
    streamed = client.completions.create(model=model_name, prompt=PROMPTS[0], stop=stop,
                                         stream=True, **greedy())
    assert "".join(c.choices[0].text for c in streamed) == cut


# "Hello there" continues with byte tokens: distinct ids among the top 3 share the text "\ufffd".
@pytest.mark.parametrize("prompt", [PROMPTS[1], "Hello there"])
def test_completion_logprobs(client: openai.OpenAI, model_name: str, prompt: str) -> None:
    out = client.completions.create(model=model_name, prompt=prompt, logprobs=3, **greedy())
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and out.usage is not None
    n = out.usage.completion_tokens
    assert logprobs.tokens is not None and len(logprobs.tokens) == n
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == n
    assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == n
    assert logprobs.text_offset is not None and len(logprobs.text_offset) == n
    for token, chosen, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                  logprobs.top_logprobs, strict=True):
        # Greedy picks the best token: its logprob is the top-1 (distinct ids may share a
        # text, so the dict can hold fewer than 3 entries).
        assert 1 <= len(top) <= 3
        assert top[token] == chosen
        assert chosen == max(top.values())
        assert chosen <= 0.0


def test_completion_logprobs_always_include_the_sampled_token(client: openai.OpenAI,
                                                               model_name: str) -> None:
    greedy_out = client.completions.create(model=model_name, prompt=PROMPTS[1], logprobs=0,
                                           **greedy())
    logprobs = greedy_out.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs == [{t: lp} for t, lp in
                                     zip(logprobs.tokens, logprobs.token_logprobs, strict=True)]
    sampled = client.completions.create(model=model_name, prompt=PROMPTS[1], logprobs=1,
                                        max_tokens=MAX_TOKENS, temperature=1.5, seed=11,
                                        extra_body={"ignore_eos": True})
    logprobs = sampled.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    for token, chosen, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                  logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and token in top
        assert max(top.values()) >= chosen


def test_chat_logprobs(client: openai.OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(model=model_name, messages=CHAT,
                                         logprobs=True, top_logprobs=2, **greedy())
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert out.usage is not None
    assert len(choice.logprobs.content) == out.usage.completion_tokens
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2
        best, second = entry.top_logprobs
        assert (entry.token, entry.logprob) == (best.token, best.logprob)
        assert best.logprob >= second.logprob
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=model_name, messages=CHAT,
                                           **greedy())
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content


# ---- prompt forms -----------------------------------------------------------------------------

def test_prompt_list_gives_one_choice_per_prompt(client: openai.OpenAI, model_name: str) -> None:
    singles = [client.completions.create(model=model_name, prompt=p, **greedy())
               for p in PROMPTS]
    both = client.completions.create(model=model_name, prompt=PROMPTS, **greedy())
    by_index = {c.index: c.text for c in both.choices}
    assert by_index == {0: singles[0].choices[0].text, 1: singles[1].choices[0].text}
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert both.usage.completion_tokens == 2 * MAX_TOKENS


def test_token_id_prompts(client: openai.OpenAI, server: ServerProcess, model_name: str) -> None:
    ids = [prompt_ids(server, prompt=p) for p in PROMPTS]
    texts = [client.completions.create(model=model_name, prompt=p, **greedy()).choices[0].text
             for p in PROMPTS]
    one = client.completions.create(model=model_name, prompt=ids[0], **greedy())
    assert one.choices[0].text == texts[0]
    assert one.usage is not None and one.usage.prompt_tokens == len(ids[0])
    many = client.completions.create(model=model_name, prompt=ids, **greedy())
    assert {c.index: c.text for c in many.choices} == {0: texts[0], 1: texts[1]}


def test_echo_prepends_the_prompt(client: openai.OpenAI, server: ServerProcess,
                                  model_name: str, tokenizer: PreTrainedTokenizerBase) -> None:
    plain = client.completions.create(model=model_name, prompt=PROMPTS[0], **greedy())
    echoed = client.completions.create(model=model_name, prompt=PROMPTS[0], echo=True,
                                       **greedy())
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = client.completions.create(model=model_name, prompt=PROMPTS[0], echo=True,
                                         stream=True, **greedy())
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    ids = prompt_ids(server, prompt=PROMPTS[1])
    by_ids = client.completions.create(model=model_name, prompt=ids, echo=True, **greedy())
    assert by_ids.choices[0].text.startswith(tokenizer.decode(ids))
