"""Default sampling parameters from the model's generation config, as vLLM's
`--generation-config` and `--override-generation-config`.

A checkpoint's generation_config.json may recommend a temperature, top_p, top_k, min_p,
repetition penalty and an output cap (`max_new_tokens`). The server uses them for every
request field the client leaves unset; a request's own value always wins. The operator can
ignore the file (`--generation-config vllm`), read another folder's, or set server-wide
defaults on top (`--override-generation-config '{"max_new_tokens": 512}'`): the usual reason
is a front-end (Open WebUI, LibreChat) that sends no max_tokens, so an answer from a small
model that rarely emits EOS would otherwise run to max_model_len.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.engine")

# generation_config.json key -> SamplingParams field: the keys vLLM reads from the file.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# The override also takes the SamplingParams names (max_tokens), as a user would write them.
_OVERRIDE_KEYS = {**GENERATION_CONFIG_KEYS, "max_tokens": "max_tokens"}


def parse_override(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """--override-generation-config as a dict: JSON text on the command line, a dict in
    Python. Raises ValueError naming the flag and the keys it takes."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--override-generation-config must be a JSON object, e.g. "
                             f"'{{\"max_new_tokens\": 512}}': {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError("--override-generation-config must be a JSON object, got "
                         f"{type(value).__name__}")
    unknown = sorted(set(value) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {unknown}; it takes "
                         f"{sorted(_OVERRIDE_KEYS)}")
    return dict(value)


def read_generation_config(setting: str, own: Mapping[str, Any]) -> dict[str, Any]:
    """The generation config that `setting` names: "auto" is the model's own (`own`: an HF
    folder's generation_config.json; a GGUF file has none), "vllm" none at all, anything
    else a folder holding a generation_config.json."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        return dict(own)
    path = Path(setting) / "generation_config.json"
    if not path.is_file():
        raise ValueError(f"--generation-config {setting!r}: no generation_config.json there; "
                         "use auto, vllm or a folder holding one")
    return dict(json.loads(path.read_text()))


def default_sampling_params(config: Mapping[str, Any],
                            override: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams defaults (by field name) from a generation config and the override.
    Checked by building a SamplingParams from them, so a bad default fails at startup."""
    defaults = {GENERATION_CONFIG_KEYS[k]: v for k, v in config.items()
                if k in GENERATION_CONFIG_KEYS and v is not None}
    defaults.update({_OVERRIDE_KEYS[k]: v for k, v in override.items() if v is not None})
    try:
        SamplingParams(**defaults)
    except (InvalidRequestError, TypeError) as exc:
        raise ValueError(f"the generation config's defaults {defaults} are invalid: {exc}") \
            from None
    if defaults:
        logger.info("Default sampling parameters have been overridden by the generation "
                    "config: %s (requests that set these fields keep their own; "
                    "--generation-config vllm ignores the model's file)", defaults)
    return defaults
