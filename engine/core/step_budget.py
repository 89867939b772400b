"""The token budget of each step when --max-num-batched-tokens is not given: adaptive.

A step that carries decodes is a pause in every stream it carries, so a prefill chunk riding
along is sized to keep that step within DECODE_STEP_MULTIPLE x what the decodes alone would
take (Sarathi-Serve's stall-free batching, with the chunk derived from measured cost instead of
a hand-picked token count). The costs come from `StepCostModel`: profiled at startup, refit on
the last steps' timings, so the chunk follows the hardware, the model, the number of streams
and the context the chunk attends over (a chunk deep into an 8k prompt attends over more and
gets fewer tokens). Prefill still moves every step: the chunk never drops below
MIN_CHUNK_TOKENS. The cap protects streams that are the majority: while more requests wait for
their first token (queued, or mid-prefill) than streams decode, a step takes the whole budget,
as vLLM's would (64 chat requests arriving at once behind one that started a moment earlier
were otherwise admitted a few per capped step, and their prefill took twice as long). Chunks of
a block or more are whole blocks; deep into a long prompt, where a block's attention over the
context alone would take the step past its limit, a chunk may be a few tokens (the streams'
pace comes first). A step with no decodes, or with nothing to prefill, takes the whole budget,
`max_tokens` (the default ceiling: max-model-len up to 8192, at least 2048 and at least
max-num-seqs), which is also the most a step can ever carry, so the activation peak profiled for it
still bounds every step. Decodes are never cut: a step's budget is the running decodes plus the
chunk.

An explicit --max-num-batched-tokens is a fixed budget and never reaches this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.core.request import Request
from engine.core.scheduler_output import SchedulerOutput
from engine.core.step_cost import (
    FEATURE_NAMES,
    StepCostModel,
    add_features,
    batch_features,
    step_features,
)

# A step carrying decodes may take this many times a decode-only step (its forward). The
# issue's target is decode ITL p99 <= 3x the undisturbed median ITL during a long prefill;
# 2.5 leaves room for the noise of a shared machine and for the model's error.
DECODE_STEP_MULTIPLE = 2.5
# The least a prefill moves in a step that carries decodes. With the prefix read in place a
# chunk's cost is its tokens' own work and their attention over the context, so deep into an
# 8k prompt on a small CPU even one block (16 tokens) took a step to ~5x a decode step: below
# a block the chunk shrinks by tokens, down to this.
MIN_CHUNK_TOKENS = 4
# The chunk before any step was measured (a scheduler built without the startup profile).
FALLBACK_CHUNK_TOKENS = 256
# Recent steps the cost model is fit on (beside the startup profile).
WINDOW_STEPS = 64


class AdaptiveStepBudget:
    """Picks each step's token budget from the running decodes and the step-cost model."""

    def __init__(self, max_tokens: int, block_size: int,
                 multiple: float = DECODE_STEP_MULTIPLE,
                 model: StepCostModel | None = None) -> None:
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.multiple = multiple
        self.min_chunk = MIN_CHUNK_TOKENS
        self.model = model if model is not None else StepCostModel(WINDOW_STEPS)
        self.last_chunk: int | None = None  # the chunk of the last capped step (None: uncapped)

    def observe(self, batch: SchedulerOutput, seconds: float) -> None:
        """Feeds a finished step's forward time into the cost model."""
        if batch.requests and seconds > 0:
            self.model.observe(batch_features(batch), seconds)

    def next_budget(self, running: Sequence[Request], waiting: Sequence[Request],
                    num_new_tokens: Callable[[Request], int]) -> int:
        """This step's budget: the running decodes plus a chunk sized by the cost model when
        something decodes, something waits to prefill and the decoding streams outnumber the
        requests still to make their first token; else `max_tokens`.
        `num_new_tokens(request)` is what the request would compute with no budget limit."""
        decode_contexts: list[int] = []
        prefill_start: int | None = None
        starting = len(waiting)  # requests still to make their first token
        for request in running:
            num_new = num_new_tokens(request)
            if num_new == 1:
                decode_contexts.append(request.num_computed_tokens + 1)
            elif num_new > 1:
                starting += 1
                if prefill_start is None:
                    prefill_start = request.num_computed_tokens
        if prefill_start is None and waiting:
            prefill_start = waiting[0].num_computed_tokens  # its prefix-cache hit is unknown yet
        if not decode_contexts or prefill_start is None or starting > len(decode_contexts):
            # More requests wait for their first token than streams decode (a burst of
            # arrivals): admitting them together is worth one long step of the few streams.
            self.last_chunk = None
            return self.max_tokens
        self.last_chunk = self.chunk_tokens(decode_contexts, prefill_start)
        return len(decode_contexts) + self.last_chunk

    def chunk_tokens(self, decode_contexts: Sequence[int], prefill_start: int) -> int:
        """The largest chunk (at least `min_chunk`; whole blocks from one block up) that keeps a
        step with these decodes within `multiple` x the decodes alone, for a prefill at
        `prefill_start`. Where not even `min_chunk` keeps it (a chunk's fixed cost, reading its
        prefix on a backend that copies it out, is past the limit alone), the least chunk whose
        tokens cost more than that fixed part."""
        cap = max(self.min_chunk, self.max_tokens - len(decode_contexts))
        if not self.model.ready:
            return min(cap, max(self.min_chunk, FALLBACK_CHUNK_TOKENS))
        decodes = step_features((1, c) for c in decode_contexts)
        alone = self.model.predict(decodes)
        fixed = self.model.predict(add_features(decodes, step_features([(0, prefill_start)])))
        fixed -= alone

        def extra(k: int) -> float:  # what a chunk of k tokens adds to the step
            chunk = step_features([(k, prefill_start + k)])
            return self.model.predict(add_features(decodes, chunk)) - alone

        allowance = (self.multiple - 1.0) * alone
        fits = self._largest(lambda k: extra(k) <= allowance, cap)
        if extra(self.min_chunk) <= allowance:
            return fits  # the streams' pace holds: the largest chunk that keeps it
        # Not even the least chunk keeps the pace (its prefix alone costs more: a backend that
        # copies the prefix out). The step will be long whatever the chunk: make it worth it.
        # the least chunk whose tokens cost more than the fixed part (whole blocks from a block)
        least = self._largest(lambda k: extra(k) - fixed < fixed, cap) + 1
        if least >= self.block_size:
            least = -(-least // self.block_size) * self.block_size
        return min(cap, max(fits, least))

    def _largest(self, ok: Callable[[int], bool], cap: int) -> int:
        """The largest chunk in [min_chunk, cap] for which `ok` holds (`ok` holds for a prefix
        of sizes), rounded down to whole blocks when it is a block or more; min_chunk when
        none."""
        lo, hi = self.min_chunk, max(self.min_chunk, cap)
        if not ok(lo):
            return self.min_chunk
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo if lo < self.block_size else lo - lo % self.block_size

    def describe(self) -> list[str]:
        """The startup log lines: what the budget is, its limits, and the model's estimate."""
        lines = [
            f"Token budget per step: adaptive (--max-num-batched-tokens not set): up to "
            f"{self.max_tokens:,} tokens while no request is decoding or more requests wait "
            f"for their first token than streams decode; otherwise, "
            f"the decodes plus a prefill chunk of {self.min_chunk:,} to "
            f"{self.max_tokens - 1:,} tokens sized to keep the step within {self.multiple:g}x "
            f"a decode-only step, by a step-cost model fit on {self.model.num_observations} "
            f"profiled steps and refit on the last {WINDOW_STEPS} steps"]
        if self.model.ready:
            coef = self.model.coefficients()
            terms = ", ".join(f"{c * 1e3:.3g} ms/{name}" for c, name in
                              zip(coef[1:], FEATURE_NAMES[1:], strict=True) if c > 0)
            lines.append(f"Step-cost model at startup: {coef[0] * 1e3:.3g} ms/step"
                         + (f", {terms}" if terms else ""))
        return lines

    def example_chunks(self, num_decodes: int, contexts: Sequence[int]) -> list[int]:
        """Chunk sizes now for `num_decodes` short decodes and a prefill at each context (for
        the log and the docs)."""
        return [self.chunk_tokens([64] * num_decodes, c) for c in contexts]
