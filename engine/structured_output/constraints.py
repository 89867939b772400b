"""What a structured-output constraint is, independent of any tokenizer: its cache key and the
cheap synchronous check that runs at input time.

A constraint (`StructuredOutputsParams`) becomes a `ConstraintKey`: its kind and one text (the
JSON schema as JSON, the regex, the EBNF grammar; a choice list becomes an EBNF grammar of
alternatives). The key is what the compile cache is keyed by, and `validate` parses it with
xgrammar's grammar front end (no token masks are built, about 0.1 ms for a schema), so an
invalid schema, regex or grammar is an InvalidRequestError before anything is queued.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Literal

import xgrammar as xgr

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams

Kind = Literal["json", "regex", "grammar"]
PARAM = "structured_outputs"  # the SamplingParams field an error names by default
# `{"type": "json_object"}`: any JSON object, written by the same schema converter so that it
# also follows the compact-whitespace rule.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: " and sometimes
# "Check failed: (...) is false: "; clients see the rest.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: .*? is false: )?")


@dataclass(frozen=True)
class ConstraintKey:
    """A compiled grammar's identity: the same key always compiles to the same grammar."""

    kind: Kind
    text: str

    def describe(self) -> str:
        """Short words for logs and errors: the kind and the text's length."""
        return f"{self.kind} constraint ({len(self.text)} characters)"


def set_fields(params: StructuredOutputsParams) -> list[str]:
    """The names of the constraint fields that are set."""
    names = []
    if params.json is not None:
        names.append("json")
    if params.json_object:
        names.append("json_object")
    if params.regex is not None:
        names.append("regex")
    if params.choice is not None:
        names.append("choice")
    if params.grammar is not None:
        names.append("grammar")
    return names


def check_shape(params: StructuredOutputsParams, param: str = PARAM) -> None:
    """Exactly one field set, each of the right type and not empty; InvalidRequestError
    otherwise. Does not parse the schema, regex or grammar (see `validate`)."""
    names = set_fields(params)
    if len(names) != 1:
        raise InvalidRequestError(
            f"{param} must set exactly one of json, json_object, regex, choice or grammar; "
            f"got {', '.join(names) if names else 'none'}", param)
    if params.json is not None and not isinstance(params.json, (dict, str)):
        raise InvalidRequestError(
            f"a JSON schema must be an object or its JSON text, not "
            f"{type(params.json).__name__}", param)
    if params.json_object is not True and params.json_object is not False:
        raise InvalidRequestError("json_object must be a boolean", param)
    for name in ("regex", "grammar"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidRequestError(f"{name} must be a non-empty string", param)
    if params.choice is not None:
        choice = params.choice
        if isinstance(choice, str) or not isinstance(choice, (tuple, list)) or not choice:
            raise InvalidRequestError("choice must be a non-empty list of strings", param)
        if not all(isinstance(c, str) and c for c in choice):
            raise InvalidRequestError("every choice must be a non-empty string", param)


def constraint_key(params: StructuredOutputsParams, param: str = PARAM) -> ConstraintKey:
    """The cache key of a constraint whose shape is valid (InvalidRequestError otherwise)."""
    check_shape(params, param)
    if params.json is not None:
        if isinstance(params.json, str):
            return ConstraintKey("json", params.json)
        try:  # key order is kept: it is the order the model writes the properties in
            return ConstraintKey("json", json.dumps(params.json, ensure_ascii=False,
                                                    allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"the JSON schema is not JSON: {exc}", param) from exc
    if params.json_object:
        return ConstraintKey("json", JSON_OBJECT_SCHEMA)
    if params.regex is not None:
        return ConstraintKey("regex", params.regex)
    if params.choice is not None:
        return ConstraintKey("grammar", choice_grammar(params.choice))
    assert params.grammar is not None
    return ConstraintKey("grammar", params.grammar)


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """An EBNF grammar whose root is exactly one of the strings (JSON escapes are EBNF's)."""
    alternatives = dict.fromkeys(json.dumps(c, ensure_ascii=False) for c in choices)
    return "root ::= " + " | ".join(alternatives)


def validate(params: StructuredOutputsParams, param: str = PARAM) -> ConstraintKey:
    """Checks a constraint the way compiling it would, without building token masks, and
    returns its key; an invalid schema, regex or grammar is an InvalidRequestError whose
    message says what xgrammar found, naming `param`."""
    key = constraint_key(params, param)
    problem = _problem(key)
    if problem is not None:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}[key.kind]
        if params.choice is not None:
            what = "choice"
        raise InvalidRequestError(f"invalid {what}: {problem}", param)
    return key


@functools.lru_cache(maxsize=1024)
def _problem(key: ConstraintKey) -> str | None:
    """What is wrong with a constraint, or None; cached, so a server that checks a request's
    field and an engine that checks it again pay once."""
    try:
        parse(key)
    except Exception as exc:  # xgrammar raises RuntimeError / InvalidJSONError with the reason
        return clean_message(exc)
    return None


def parse(key: ConstraintKey) -> xgr.Grammar:
    """The xgrammar Grammar of a key (parsing only: no tokenizer, no masks)."""
    if key.kind == "json":
        return xgr.Grammar.from_json_schema(key.text, any_whitespace=False)
    if key.kind == "regex":
        return xgr.Grammar.from_regex(key.text)
    return xgr.Grammar.from_ebnf(key.text)


def clean_message(exc: BaseException) -> str:
    """xgrammar's message without its timestamp and source-location prefix."""
    text = str(exc).strip()
    text = _XGR_PREFIX.sub("", text).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__
