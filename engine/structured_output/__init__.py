"""Structured outputs: grammar-constrained decoding with xgrammar, as vLLM's default backend.

A request's `SamplingParams.structured_outputs` (a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF grammar) is checked at input time (`constraints.validate`: an
invalid schema is an InvalidRequestError), compiled on a background thread with a cache by
constraint (`manager.StructuredOutputManager`), waited for by the scheduler, and enforced in the
sampler as a token bitmask over the batch's constrained rows (`matchers.GrammarMatchers`).
"""

from engine.structured_output.constraints import (
    ConstraintKey,
    constraint_key,
    validate,
)
from engine.structured_output.manager import CompileStats, StructuredOutputManager
from engine.structured_output.matchers import AcceptResult, GrammarMatchers

__all__ = ["AcceptResult", "CompileStats", "ConstraintKey", "GrammarMatchers",
           "StructuredOutputManager", "constraint_key", "validate"]
