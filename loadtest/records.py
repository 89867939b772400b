"""What one streamed request did, whatever carried it (SSE or the WebSocket).

`RequestRecord` holds the timings the harness reports: TTFT (send to first content), the gaps
between later content chunks (ITL), end to end, plus token counts and, for failures, an error
kind and the server's error text. `ChunkTimer` fills one in as content arrives; both clients
use it so their numbers mean the same thing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request's outcome; times are seconds from sending it, except `start_s`, which is
    when it was sent, in seconds from the start of the run (set by the runner)."""

    ok: bool = False
    status: int | None = None
    error: str = ""
    error_kind: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    text: str = ""
    start_s: float = 0.0

    def token_times(self) -> list[float]:
        """Arrival times of each content chunk, in seconds from the start of the run."""
        if self.ttft_s is None:
            return []
        times = [self.start_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times

    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1), as vLLM's
        benchmark defines it; None for fewer than two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """The fields a result file keeps (the text is left out)."""
        return {"start_s": self.start_s, "ok": self.ok, "status": self.status,
                "error_kind": self.error_kind, "error": self.error, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s(), "itl_s": self.itl_s, "e2e_s": self.e2e_s,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "usage_reported": self.usage_reported, "finish_reason": self.finish_reason}


def fail(record: RequestRecord, kind: str, message: str) -> None:
    """Marks a record failed with an error kind (counted by kind in the summary) and text."""
    record.ok = False
    record.error_kind = kind
    record.error = message


def http_error_kind(status: int, body: str) -> str:
    """"http_<status>" plus the OpenAI error type when the body carries one."""
    try:
        import orjson

        parsed = orjson.loads(body)
    except ValueError:
        return f"http_{status}"
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        etype = parsed["error"].get("type")
        if isinstance(etype, str) and etype:
            return f"http_{status}:{etype}"
    return f"http_{status}"


def chunk_content(chunk: dict[str, Any]) -> tuple[str, str | None]:
    """(text delta, finish_reason) of a chat or text-completion chunk; ("", None) for a
    usage-only chunk with no choices."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    delta = choice.get("delta")
    text = (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
    return text, choice.get("finish_reason")


def error_text(error: Any) -> str:
    """A one-line message from an OpenAI-style `error` value (a dict or a plain string)."""
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


class ChunkTimer:
    """Collects content-chunk arrival times into a record as they come."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.start = time.perf_counter()
        self.last: float | None = None
        self.chunks = 0
        self.parts: list[str] = []

    def content(self, text: str) -> None:
        """Stamps one content chunk: TTFT for the first, an ITL gap for the others."""
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft_s = now - self.start
        else:
            self.record.itl_s.append(now - self.last)
        self.last = now
        self.chunks += 1
        self.parts.append(text)

    def apply_chunk(self, chunk: dict[str, Any]) -> None:
        """Applies one OpenAI streaming chunk (content, finish_reason, usage)."""
        text, finish = chunk_content(chunk)
        if text:
            self.content(text)
        if finish is not None:
            self.record.finish_reason = finish
        self.apply_usage(chunk.get("usage"))

    def apply_usage(self, usage: Any) -> None:
        """Takes the token counts from a `usage` object when the server sent one."""
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.record.usage_reported = True
            self.record.output_tokens = int(usage["completion_tokens"])
            self.record.prompt_tokens = usage.get("prompt_tokens")

    def finish(self) -> RequestRecord:
        """Closes the record: end-to-end time, text, and a token count without usage."""
        rec = self.record
        rec.e2e_s = time.perf_counter() - self.start
        rec.text = "".join(self.parts)
        if not rec.usage_reported:
            rec.output_tokens = self.chunks  # one token a chunk is the best guess without usage
        return rec
