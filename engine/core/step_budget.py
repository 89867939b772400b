"""The token budget of each step when --max-num-batched-tokens is not given: adaptive.

A step that carries decodes is a pause in every stream it carries, so a prefill chunk riding
along is sized to keep that step within DECODE_STEP_MULTIPLE x what the decodes alone were
measured to take in their recent decode-only steps (Sarathi-Serve's stall-free batching, with
the chunk derived from measured cost instead of a hand-picked token count). The chunk's cost
comes from `StepCostModel`: profiled at startup, refit on the last steps' timings, so the chunk
follows the hardware, the model, the number of streams and the context the chunk attends over
(a chunk deep into an 8k prompt attends over more and gets fewer tokens). Prefill still moves
every step: the chunk never drops below MIN_CHUNK_TOKENS. The cap protects streams that are the
majority: while more requests wait for their first token (queued, or mid-prefill) than streams
decode, a step takes the whole budget, as vLLM's would (64 chat requests arriving at once
behind one that started a moment earlier were otherwise admitted a few per capped step, and
their prefill took twice as long). Chunks of a block or more are whole blocks; deep into a long
prompt, where a block's attention over the context alone would take the step past its limit, a
chunk may be a few tokens, in whole row tiles of the attention kernel (the streams' pace comes
first). A step with no decodes, or with nothing to prefill, takes the whole budget,
`max_tokens` (the default ceiling: max-model-len up to 8192, at least 2048 and at least
max-num-seqs), which is also the most a step can ever carry, so the activation peak profiled
for it still bounds every step. Decodes are never cut: a step's budget is the running decodes
plus the chunk.

An explicit --max-num-batched-tokens is a fixed budget and never reaches this module.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence

from engine.core.request import Request
from engine.core.scheduler_output import SchedulerOutput
from engine.core.step_cost import (
    FEATURE_NAMES,
    Features,
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
# Decode-only steps kept per number of decode rows: their measured forwards are the pace a
# capped step is held to (the model's own decode-only prediction is an extrapolation once the
# window holds only mixed steps: during an 8k prefill it wandered between 14 and 26 ms for
# decoders whose steps took 17, and the cap with it).
REFERENCE_STEPS = 16
# Measured decode-only steps needed before they replace the model's prediction.
MIN_REFERENCE_STEPS = 3
# A chunk is at most this many times the last measured step's chunk (or one block): the model's
# refit on a window of near-identical steps can lose its per-token terms and call any chunk
# free (a 2-core VM in a noisy phase: from context 2,500 of an 8k prompt it took chunks of
# hundreds of tokens, one step 55x its prediction).
MAX_CHUNK_GROWTH = 2.0
# A measured step with a chunk this far past the limit shrinks the next chunk by the overrun
# (below it, noise: steps land up to ~1.2x their prediction on a shared 2-core VM).
OVERRUN_TOLERANCE = 1.25


class AdaptiveStepBudget:
    """Picks each step's token budget from the running decodes and the step-cost model."""

    def __init__(self, max_tokens: int, block_size: int,
                 multiple: float = DECODE_STEP_MULTIPLE,
                 model: StepCostModel | None = None, granule: int = 1) -> None:
        self.max_tokens = max_tokens
        self.block_size = block_size
        # Below a block, chunks are multiples of this many tokens (from one granule up): the
        # tokens whose query rows fill one of the attention kernel's row tiles (CPU: 16 rows,
        # SmolLM2's 3 query heads per KV head -> 5 tokens; a 6-token chunk's 18 rows took two
        # tiles, the cost of 10 tokens).
        self.granule = max(1, granule)
        self.multiple = multiple
        self.min_chunk = MIN_CHUNK_TOKENS
        self.model = model if model is not None else StepCostModel(WINDOW_STEPS)
        self.last_chunk: int | None = None  # the chunk of the last capped step (None: uncapped)
        # decode rows -> the seconds of recent decode-only steps with that many rows
        self._decode_steps: dict[int, deque[float]] = {}
        self._last_mixed: tuple[int, float] | None = None  # (chunk tokens, seconds) measured

    def observe(self, batch: SchedulerOutput, seconds: float) -> None:
        """Feeds a finished step's forward time into the cost model (and, for a step in which
        every row decodes, into the measured decode-only pace)."""
        if not batch.requests or seconds <= 0:
            return
        features = batch_features(batch)
        self.model.observe(features, seconds)
        if features[1] == features[2]:
            self._decode_steps.setdefault(int(features[2]), deque(maxlen=REFERENCE_STEPS)
                                          ).append(seconds)
        elif features[2]:  # decodes beside prefill tokens
            self._last_mixed = (int(features[1] - features[2]), seconds)

    def decode_step_seconds(self, decodes: Features) -> float:
        """What a step of these decodes alone takes: the median of the recent measured
        decode-only steps with as many rows (the model's prediction until a few were measured).
        During a long prefill none is measured and the decoders' contexts grow, so this is the
        pace they had before it: the pace the cap is meant to keep."""
        measured = self._decode_steps.get(int(decodes[2]), ())
        if len(measured) < MIN_REFERENCE_STEPS:
            return self.model.predict(decodes)
        return statistics.median(measured)

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
        """The largest chunk (at least `min_chunk`; whole blocks from one block up, whole
        granules below) whose step with these decodes the model predicts within `multiple` x
        the decodes' own step as measured (`decode_step_seconds`), for a prefill at
        `prefill_start`. Where not even `min_chunk` keeps within it (a chunk's fixed cost, its
        attention over a long prefix, is past the limit alone), the least chunk whose tokens
        cost more than that fixed part."""
        cap = max(self.min_chunk, self.max_tokens - len(decode_contexts))
        if not self.model.ready:
            return min(cap, max(self.min_chunk, FALLBACK_CHUNK_TOKENS))
        decodes = step_features((1, c) for c in decode_contexts)
        alone = self.model.predict(decodes)
        limit = self.multiple * self.decode_step_seconds(decodes)
        fixed = self.model.predict(add_features(decodes, step_features([(0, prefill_start)])))
        fixed -= alone

        def with_chunk(k: int) -> float:  # the predicted step with a chunk of k tokens
            return self.model.predict(add_features(decodes,
                                                   step_features([(k, prefill_start + k)])))

        def extra(k: int) -> float:  # what a chunk of k tokens adds to the step
            return with_chunk(k) - alone

        fits = self._largest(lambda k: with_chunk(k) <= limit, cap)
        if with_chunk(self.min_chunk) <= limit:
            return self._measured_bound(fits, limit)  # the largest chunk that keeps the pace
        # Not even the least chunk keeps the pace (its prefix alone costs more: a backend that
        # copies the prefix out). The step will be long whatever the chunk: make it worth it.
        # the least chunk whose tokens cost more than the fixed part (whole blocks from a block)
        least = self._largest(lambda k: extra(k) - fixed < fixed, cap) + 1
        step = self.block_size if least >= self.block_size else self.granule
        least = -(-least // step) * step
        return self._measured_bound(min(cap, max(fits, least)), limit)

    def _measured_bound(self, chunk: int, limit: float) -> int:
        """`chunk`, held to what the last measured step with a chunk says, whatever the model
        predicts: after a step well past `limit`, its chunk scaled down by the overrun (the
        streams' pace first); otherwise at most MAX_CHUNK_GROWTH x its chunk (or a block)."""
        if self._last_mixed is None:
            return chunk
        tokens, seconds = self._last_mixed
        bound = int(tokens * limit / seconds) if seconds > OVERRUN_TOLERANCE * limit else \
            max(self.block_size, int(MAX_CHUNK_GROWTH * tokens))
        if chunk <= bound:
            return chunk
        return self._largest(lambda k: k <= bound, bound)

    def _largest(self, ok: Callable[[int], bool], cap: int) -> int:
        """The largest chunk in [min_chunk, cap] for which `ok` holds (`ok` holds for a prefix
        of sizes), rounded down to whole blocks when it is a block or more, else to whole
        granules from one granule up; min_chunk when none."""
        lo, hi = self.min_chunk, max(self.min_chunk, cap)
        if not ok(lo):
            return self.min_chunk
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        if lo >= self.block_size:
            return lo - lo % self.block_size
        return lo if lo < self.granule else lo - lo % self.granule

    def describe(self) -> list[str]:
        """The startup log lines: what the budget is, its limits, and the model's estimate."""
        lines = [
            f"Token budget per step: adaptive (--max-num-batched-tokens not set): up to "
            f"{self.max_tokens:,} tokens while no request is decoding or more requests wait "
            f"for their first token than streams decode; otherwise, "
            f"the decodes plus a prefill chunk of {self.min_chunk:,} to "
            f"{self.max_tokens - 1:,} tokens sized to keep the step within {self.multiple:g}x "
            f"the decodes' measured decode-only step, by a step-cost model fit on "
            f"{self.model.num_observations} profiled steps and refit on the last "
            f"{WINDOW_STEPS} steps"]
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
