"""The quantization benchmark's perplexity: a fixed English text shipped with the interpreter
(the standard library's LICENSE.txt: the history of Python and its license terms), tokenized by
the model's own tokenizer, is fed through the engine's own forward (`runner.model` over the
paged KV cache, the inputs built by `prepare_inputs` as a prefill step builds them) in windows
of W tokens moved S tokens at a time.

Every token after the first is predicted once, from the window that first contains it past its
overlap, so each prediction sees at least W - S tokens of context (all earlier tokens inside the
first window). The natural-log probability of the true next token comes from `compute_logits` +
log-softmax in float32; perplexity is exp(mean negative log-likelihood). The engine has no prompt
logprobs, and sampling with `logprobs` scores only the token it picked, so the forced tokens are
scored this way: the same modules, kernels and KV cache a request runs through, without the
scheduler. The suite entry is `loadtest.benchmarks.quantization`.
"""

from __future__ import annotations

import hashlib
import math
import platform
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine import SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.worker.input_batch import prepare_inputs
from engine.worker.model_runner import ModelRunner

LOGIT_ROWS = 256  # log-softmax this many positions at a time (vocabulary 49,152)


# ---- the text -----------------------------------------------------------------------------


def text_path() -> Path:
    """The standard library's LICENSE.txt (ships with CPython; plain English prose)."""
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def load_text(tokenizer: Any, limit: int | None) -> tuple[list[int], dict[str, Any]]:
    """The text's token ids (no special tokens added) and where they came from."""
    path = text_path()
    raw = path.read_bytes()
    ids = list(tokenizer.encode(raw.decode("utf-8"), add_special_tokens=False))
    full = len(ids)
    ids = ids[:limit] if limit else ids
    return ids, {"path": str(path), "name": f"LICENSE.txt of Python {platform.python_version()}"
                 "'s standard library", "bytes": len(raw), "words": len(raw.split()),
                 "sha256": hashlib.sha256(raw).hexdigest()[:16], "tokens": full,
                 "tokens_used": len(ids)}


# ---- perplexity through the engine's forward ----------------------------------------------


@torch.inference_mode()
def window_logprobs(runner: ModelRunner, ids: Sequence[int], first: int) -> torch.Tensor:
    """Natural-log probabilities of ids[first:] given everything before them in `ids` (one
    prefill of `ids` from position 0 through the engine's model and paged KV cache)."""
    bs = runner.block_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    request = ScheduledRequest("perplexity", tuple(ids), 0, tuple(range(-(-len(ids) // bs))),
                               False, params)
    inputs = prepare_inputs(SchedulerOutput((request,)), bs, runner.config.sliding_window,
                            runner.device)
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    targets = torch.tensor(ids[first:], dtype=torch.long, device=hidden.device)
    rows = hidden[first - 1:len(ids) - 1]  # row i predicts token i + 1
    out = []
    for start in range(0, rows.shape[0], LOGIT_ROWS):
        logits = runner.model.compute_logits(rows[start:start + LOGIT_ROWS])
        lp = torch.log_softmax(logits.float(), dim=-1)
        out.append(lp.gather(1, targets[start:start + LOGIT_ROWS, None]).squeeze(1))
    return torch.cat(out)


def perplexity(runner: ModelRunner, ids: Sequence[int], window: int, stride: int
               ) -> dict[str, Any]:
    """Sliding-window perplexity: each token after the first scored once (see module doc).

    Runs between steps with no request in flight: the windows use KV blocks 0.. directly,
    which the scheduler hands out (and overwrites) only later.
    """
    start, total, scored, windows, prev_end = time.perf_counter(), 0.0, 0, 0, 1
    for begin in range(0, max(len(ids) - 1, 1), stride):
        end = min(begin + window, len(ids))
        lps = window_logprobs(runner, ids[begin:end], prev_end - begin)
        total -= float(lps.double().sum())
        scored += lps.numel()
        windows += 1
        prev_end = end
        if end == len(ids):
            break
    nll = total / scored
    return {"perplexity": math.exp(nll), "nll": nll, "scored_tokens": scored,
            "windows": windows, "seconds": time.perf_counter() - start}
