"""Tool-call texts and tools shared by the parser and request tests of tool calls."""

from __future__ import annotations

from typing import Any

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]
REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Par\\"is}", "n": [1, {"x": 2}]}},'
            ' {"parameters": {"zone": "CET"}, "name": "get_time"}, {"name": "get_time"}]')
