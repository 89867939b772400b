"""Compiles constraints into xgrammar grammars, off the event loop, with a cache by constraint.

One manager per engine. Its xgrammar `TokenizerInfo` (the tokenizer's vocabulary, the model's
logits width, the engine's EOS ids as the grammar's stop tokens) and `GrammarCompiler` are built
on the compile thread the first time a constrained request arrives, so an engine that never sees
one pays nothing. `submit` returns a Future the scheduler polls: a request is not scheduled
until its grammar is ready (vLLM V1's WAITING_FOR_FSM), and a compile failure finishes that
request with an error, never the engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from engine.structured_output.constraints import ConstraintKey

logger = logging.getLogger("kvserve")

CACHE_SIZE = 256  # compiled grammars kept (LRU); a grammar of a few KB to a few MB each


@dataclass
class CompileStats:
    """Cache counters (the benchmark and tests read them)."""

    hits: int = 0
    misses: int = 0
    failures: int = 0
    compile_seconds: float = 0.0  # summed over cache misses, on the compile thread


class StructuredOutputManager:
    """Turns constraint keys into `xgr.CompiledGrammar`s on a background thread, cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_size: int = CACHE_SIZE, max_threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits width; may exceed the tokenizer's
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.max_threads = max_threads or max(1, min(8, os.cpu_count() or 1))
        self.stats = CompileStats()
        self._cache: OrderedDict[ConstraintKey, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # the cache: touched by the caller and the done callback
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")

    def submit(self, key: ConstraintKey) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `key`: a finished Future on a cache hit, else one that the
        compile thread completes (with the grammar, or the exception compiling raised)."""
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return future
            self.stats.misses += 1
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failure(key, f))
        return future

    def compile(self, key: ConstraintKey) -> xgr.CompiledGrammar:
        """Compiles now, on the caller's thread, through the cache (benchmarks, tests)."""
        return self.submit(key).result()

    def shutdown(self) -> None:
        """Stops the compile thread (pending compiles finish first)."""
        self._pool.shutdown(wait=True)

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """The xgrammar compiler (built on first use)."""
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size,
                stop_token_ids=sorted(self.eos_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
        return self._compiler

    def _compile(self, key: ConstraintKey) -> xgr.CompiledGrammar:
        started = time.perf_counter()
        compiler = self.compiler
        if key.kind == "json":
            grammar = compiler.compile_json_schema(key.text, any_whitespace=False)
        elif key.kind == "regex":
            grammar = compiler.compile_regex(key.text)
        else:
            grammar = compiler.compile_grammar(key.text)
        self.stats.compile_seconds += time.perf_counter() - started
        return grammar

    def _forget_failure(self, key: ConstraintKey, future: Future[xgr.CompiledGrammar]) -> None:
        """A failed compile is not cached: the next request with that key tries again."""
        if future.cancelled() or future.exception() is None:
            return
        logger.warning("compiling a %s failed: %s", key.describe(), future.exception())
        with self._lock:
            self.stats.failures += 1
            if self._cache.get(key) is future:
                del self._cache[key]
