"""The load harness's arithmetic and scheduling: arrivals, statistics, goodput, datasets and
the runner's cap and time limit, against hand-computed values and a fake transport."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Sequence

import pytest

from loadtest.arrivals import arrival_gaps, send_times
from loadtest.datasets import DatasetSpec, Prompt, build_prompts, to_request
from loadtest.records import RequestRecord
from loadtest.runner import LoadConfig, _drive
from loadtest.sse_client import StreamRequest
from loadtest.stats import distribution, meets_slos, parse_goodput, summarize

# ---- arrivals -------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.5, 4.0, 200.0])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_rate_within_5_percent(rate: float, burstiness: float) -> None:
    gaps = arrival_gaps(rate, burstiness, 10_000, seed=7)
    measured = len(gaps) / sum(gaps)
    assert abs(measured - rate) / rate < 0.05


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_variance_as_the_gamma_law_says(burstiness: float) -> None:
    rate = 5.0
    gaps = arrival_gaps(rate, burstiness, 10_000, seed=3)
    expected = 1.0 / (burstiness * rate ** 2)  # gamma(k=B, theta=1/(R B)): k theta^2
    assert statistics.pvariance(gaps) == pytest.approx(expected, rel=0.15)


def test_lower_burstiness_means_burstier_arrivals() -> None:
    cv = [statistics.pstdev(g) / statistics.fmean(g)
          for g in (arrival_gaps(2.0, b, 10_000, seed=1) for b in (0.25, 1.0, 4.0))]
    assert cv[0] > cv[1] > cv[2]
    assert cv[1] == pytest.approx(1.0, rel=0.05)  # exponential gaps: std equals the mean


def test_infinite_rate_sends_at_once_and_seeds_reproduce() -> None:
    assert arrival_gaps(math.inf, 1.0, 5, seed=0) == [0.0] * 5
    assert arrival_gaps(3.0, 0.5, 50, seed=9) == arrival_gaps(3.0, 0.5, 50, seed=9)
    assert arrival_gaps(3.0, 0.5, 50, seed=9) != arrival_gaps(3.0, 0.5, 50, seed=10)
    assert send_times([0.5, 0.25, 1.0]) == [0.5, 0.75, 1.75]


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0),
                                             (1.0, 0.0), (1.0, math.inf)])
def test_bad_arrival_parameters_raise(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_gaps(rate, burstiness, 3, seed=0)


# ---- statistics -----------------------------------------------------------------------------


def test_distribution_of_a_known_sample() -> None:
    dist = distribution([float(v) for v in range(1, 11)])  # 1..10 s
    # by hand: mean 5.5; median between 5 and 6; p90 at rank 8.1 -> 9.1; p99 at 8.91 -> 9.91;
    # population variance of 1..10 is (100 - 1) / 12 = 8.25
    assert dist["mean"] == pytest.approx(5500.0)
    assert dist["median"] == pytest.approx(5500.0)
    assert dist["p90"] == pytest.approx(9100.0)
    assert dist["p99"] == pytest.approx(9910.0)
    assert dist["std"] == pytest.approx(math.sqrt(8.25) * 1000)
    assert distribution([]) == {"mean": None, "median": None, "p90": None, "p99": None,
                                "std": None}


def record(ttft: float, gaps: Sequence[float], tokens: int, ok: bool = True,
           prompt_tokens: int = 10, kind: str = "") -> RequestRecord:
    rec = RequestRecord(ok=ok, ttft_s=ttft if ok else None, itl_s=list(gaps),
                        e2e_s=ttft + sum(gaps), output_tokens=tokens,
                        prompt_tokens=prompt_tokens, error_kind=kind, error=kind)
    return rec


def test_tpot_and_goodput_on_known_requests() -> None:
    fast = record(0.1, [0.02] * 9, 10)        # TPOT = 0.18 / 9 = 20 ms, E2E 280 ms
    slow_start = record(0.9, [0.02] * 9, 10)  # TTFT 900 ms
    slow_tokens = record(0.1, [0.08] * 9, 10)  # TPOT 80 ms
    single = record(0.2, [], 1)               # no TPOT: passes the TPOT SLO
    failed = record(0.0, [], 0, ok=False, kind="http_400")
    assert fast.tpot_s() == pytest.approx(0.02)
    assert single.tpot_s() is None
    slos = parse_goodput(["ttft:500", "tpot:50"])
    assert slos == {"ttft": 500.0, "tpot": 50.0}
    assert [meets_slos(r, slos) for r in (fast, slow_start, slow_tokens, single, failed)] == [
        True, False, False, True, False]
    summary = summarize([fast, slow_start, slow_tokens, single, failed], duration_s=2.0,
                        slos=slos)
    assert summary["goodput"]["good_requests"] == 2
    assert summary["goodput"]["request_throughput"] == pytest.approx(1.0)
    assert summary["successful_requests"] == 4 and summary["failed_requests"] == 1
    assert summary["total_output_tokens"] == 31
    assert summary["total_input_tokens"] == 40
    assert summary["output_throughput"] == pytest.approx(15.5)
    assert summary["total_token_throughput"] == pytest.approx(35.5)
    assert summary["request_throughput"] == pytest.approx(2.0)
    assert summary["itl_ms"]["median"] == pytest.approx(20.0)  # 18 gaps of 20 ms, 9 of 80
    assert summary["failures_by_kind"] == {"http_400": 1}


@pytest.mark.parametrize("spec", ["ttft", "ttft:", "ttft:abc", "itl:5", "ttft:-1", "tpot:inf"])
def test_bad_goodput_specs_raise(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_goodput([spec])


def test_failures_counted_by_kind_with_an_example_each() -> None:
    recs = [record(0, [], 0, ok=False, kind=k) for k in
            ("http_400:invalid_request_error", "connection_error", "http_400:"
             "invalid_request_error", "timeout")]
    summary = summarize(recs, duration_s=1.0)
    assert summary["failures_by_kind"] == {"http_400:invalid_request_error": 2,
                                           "connection_error": 1, "timeout": 1}
    assert set(summary["failure_examples"]) == set(summary["failures_by_kind"])
    assert summary["successful_requests"] == 0 and summary["ttft_ms"]["mean"] is None


# ---- datasets -------------------------------------------------------------------------------


class WordTokenizer:
    """One id a word: enough to check lengths and sharing exactly."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


def test_random_prompts_have_the_requested_lengths_and_reproduce() -> None:
    tok = WordTokenizer()
    spec = DatasetSpec("random", num_prompts=50, input_len=100, output_len=20, range_ratio=0.5,
                       seed=4)
    prompts = build_prompts(spec, tok)
    assert len(prompts) == 50
    assert all(50 <= p.prompt_len <= 150 and p.prompt_len == len(p.token_ids or []) for p in prompts)
    assert all(10 <= (p.output_len or 0) <= 30 for p in prompts)
    assert len({p.prompt_len for p in prompts}) > 10
    again = build_prompts(spec, tok)
    assert [p.token_ids for p in again] == [p.token_ids for p in prompts]


def test_shared_prefix_prompts_share_exactly_the_prefix() -> None:
    spec = DatasetSpec("shared-prefix", num_prompts=6, input_len=8, prefix_len=32,
                       num_prefixes=2, seed=1)
    prompts = build_prompts(spec, WordTokenizer())
    ids = [p.token_ids or [] for p in prompts]
    assert all(len(x) == 40 for x in ids)
    assert ids[0][:32] == ids[2][:32] == ids[4][:32]
    assert ids[1][:32] == ids[3][:32] and ids[0][:32] != ids[1][:32]
    assert len({tuple(x[32:]) for x in ids}) == 6


def test_long_prompt_dataset_pins_one_long_prompt() -> None:
    spec = DatasetSpec("long-prompt", num_prompts=5, input_len=16, long_prompt_len=300,
                       long_prompt_delay=1.5)
    prompts = build_prompts(spec, WordTokenizer())
    pinned = [p for p in prompts if p.send_at_s is not None]
    assert len(prompts) == 5 and len(pinned) == 1
    assert pinned[0].prompt_len == 300 and pinned[0].send_at_s == 1.5


def test_jsonl_dataset_and_request_bodies(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two three", "max_tokens": 5}\n\n'
                    '{"messages": [{"role": "user", "content": "four five"}]}\n')
    spec = DatasetSpec("jsonl", num_prompts=3, output_len=9, path=str(path))
    prompts = build_prompts(spec, WordTokenizer())
    assert [(p.prompt_len, p.output_len) for p in prompts] == [(3, 5), (2, 9), (3, 5)]
    chat = to_request(prompts[1], "chat", "m", {"temperature": 0.0}, send_ids=False)
    assert chat.payload["messages"] == [{"role": "user", "content": "four five"}]
    comp = to_request(prompts[0], "completions", "m", {}, send_ids=False)
    assert comp == StreamRequest("completions", {"model": "m", "max_tokens": 5,
                                                 "prompt": "one two three"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        build_prompts(DatasetSpec("jsonl", path=str(bad)), WordTokenizer())


def test_token_id_prompts_are_sent_as_ids_when_asked() -> None:
    prompt = Prompt(3, 4, token_ids=[5, 6, 7], text="a b c")
    assert to_request(prompt, "completions", "m", {}, send_ids=True).payload["prompt"] == [5, 6, 7]
    assert to_request(prompt, "completions", "m", {}, send_ids=False).payload["prompt"] == "a b c"


# ---- runner (fake transport) ----------------------------------------------------------------


class FakeTransport:
    """Answers after `latency_s`, tracking the most requests ever in flight; raises on "boom"."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.in_flight = self.max_in_flight = 0
        self.sent_at: dict[str, float] = {}

    async def stream(self, req: StreamRequest, include_usage: bool = True,
                     timeout_s: float = 600.0) -> RequestRecord:
        if req.payload["prompt"] == "boom":
            raise RuntimeError("transport bug")
        self.sent_at[req.payload["prompt"]] = time.perf_counter()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.latency_s)
        self.in_flight -= 1
        return RequestRecord(ok=True, ttft_s=self.latency_s, e2e_s=self.latency_s,
                             output_tokens=1)


def drive(cfg: LoadConfig, prompts: list[Prompt], transport: FakeTransport):
    requests = [StreamRequest("completions", {"prompt": p.text}) for p in prompts]
    return asyncio.run(_drive(cfg, transport, requests, prompts))


def prompts_named(n: int) -> list[Prompt]:
    return [Prompt(7, 1, text=f"p{i}") for i in range(n)]


def test_concurrency_cap_is_never_exceeded_and_every_request_runs() -> None:
    transport = FakeTransport(0.02)
    run, duration = drive(LoadConfig(max_concurrency=3, progress=False), prompts_named(12),
                          transport)
    assert transport.max_in_flight == 3
    assert len(run.records) == 12 and all(r.ok for r in run.records.values())
    assert all(r.prompt_tokens == 7 for r in run.records.values())  # no usage: dataset length
    assert duration >= 4 * 0.02  # 12 requests, 3 at a time


def test_duration_stops_sending_and_pinned_prompts_keep_their_time() -> None:
    prompts = prompts_named(100)
    prompts.append(Prompt(7, 1, text="late", send_at_s=0.15))
    transport = FakeTransport(0.01)
    run, _ = drive(LoadConfig(request_rate=50.0, duration_s=0.4, progress=False), prompts,
                   transport)
    assert 5 <= len(run.records) < 60  # ~20 expected at 50/s for 0.4 s; never all 101
    late = [r for i, r in run.records.items() if i == 100]
    assert late and late[0].start_s == pytest.approx(0.15, abs=0.05)


def test_a_transport_exception_is_counted_not_raised() -> None:
    prompts = prompts_named(3) + [Prompt(1, 1, text="boom")]
    run, _ = drive(LoadConfig(progress=False), prompts, FakeTransport(0.0))
    kinds = sorted(r.error_kind for r in run.records.values())
    assert kinds == ["", "", "", "client_error"]
