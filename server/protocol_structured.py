"""The structured-output and logit_bias fields of a request (README, "Structured outputs"):
OpenAI's response_format, vLLM's guided_* extras and its newer structured_outputs object, and
their translation into the engine's one StructuredOutputsParams."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.constraints import validate as validate_constraint

if TYPE_CHECKING:
    from server.protocol import SamplingFields

MAX_CHOICE_ITEMS = 1024  # strings in guided_choice / structured_outputs.choice
MAX_LOGIT_BIAS = 4096  # entries in logit_bias (OpenAI documents no cap; vLLM has none)
TokenIdKey = Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")]  # OpenAI sends token ids as keys
LogitBias = Annotated[dict[TokenIdKey, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                      Meta(max_length=MAX_LOGIT_BIAS)]
Choices = Annotated[list[Annotated[str, Meta(min_length=1)]],
                    Meta(min_length=1, max_length=MAX_CHOICE_ITEMS)]
JsonSchema = dict[str, Any] | str  # a JSON schema, or its JSON text (vLLM accepts both)


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """response_format's `json_schema`: OpenAI's name, description, schema and strict."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs` request object: set exactly one constraint."""

    json: JsonSchema | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's one constraint (response_format, guided_*, structured_outputs), checked
    as the engine will check it so an error names the field the client sent; None without."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise InvalidRequestError("response_format of type json_schema needs "
                                      "json_schema.schema, the JSON schema", "response_format")
        found.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.schema)))
    guided = {"guided_json": StructuredOutputsParams(json=req.guided_json),
              "guided_regex": StructuredOutputsParams(regex=req.guided_regex),
              "guided_choice": StructuredOutputsParams(
                  choice=None if req.guided_choice is None else tuple(req.guided_choice)),
              "guided_grammar": StructuredOutputsParams(grammar=req.guided_grammar)}
    found += [(name, params) for name, params in guided.items() if getattr(req, name) is not None]
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", StructuredOutputsParams(
            json=so.json, json_object=bool(so.json_object), regex=so.regex,
            choice=None if so.choice is None else tuple(so.choice), grammar=so.grammar)))
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise InvalidRequestError(f"set at most one output constraint; got {' and '.join(names)}",
                                  names[1])
    name, params = found[0]
    validate_constraint(params, name)
    return params


def logit_bias_of(req: SamplingFields) -> dict[int, float] | None:
    """logit_bias with integer token ids (the engine checks them against the vocabulary)."""
    if not req.logit_bias:
        return None
    return {int(token): float(bias) for token, bias in req.logit_bias.items()}
