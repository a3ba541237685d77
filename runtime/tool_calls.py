"""Tool calling for /v1/chat/completions: the request's tools, how tool_choice constrains the
output, and the parsers that find calls in what a model wrote.

- `none`: the tools go to the chat template (the model may read them) and nothing is parsed.
- `auto`: the model writes freely; the served model's tool parser (`tool_parser:` in its zoo
  YAML, or `--tool-call-parser`) splits the text into content and calls.
- `required`: the output is constrained (structured outputs) to a JSON array of one or more
  {"name", "parameters"} objects, one of the tools each, as vLLM does.
- a named function: the output is constrained to that function's parameters schema and is
  the call's arguments.
Arguments always leave as a JSON string (OpenAI's shape); the template gets them as objects,
which is what HF chat templates iterate over.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from runtime.limits import ParamError
from runtime.structured_outputs import StructuredOutputsParams
from runtime.tool_stream import CallScan, scan_array, scan_call


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                  # JSON text

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def check_tools(tools: list[dict] | None, tool_choice) -> tuple[list[dict], str | None]:
    """Validate `tools` and `tool_choice`; returns (the tools as the template takes them, the
    mode: None (no tools), "none", "auto", "required" or "named:<function name>")."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ParamError("tool_choice: needs tools", "tool_choice")
        return [], None
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ParamError(f"tools[{i}]: must be {{type: function, function: {{name, parameters}}}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ParamError(f"tools[{i}].function.name: 1 to 64 letters, digits, _ . or -", f"tools[{i}].function.name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ParamError(f"tools[{i}].function.parameters: must be a JSON schema object",
                             f"tools[{i}].function.parameters")
        names.append(name)
    if len(set(names)) != len(names):
        raise ParamError("tools: function names must be unique", "tools")
    if tool_choice in (None, "auto"):
        mode = "auto"
    elif tool_choice in ("none", "required"):
        mode = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ParamError(f"tool_choice: no tool named {str(name)[:64]!r}", "tool_choice")
        mode = f"named:{name}"
    else:
        raise ParamError("tool_choice: must be none, auto, required or {type: function, function: {name}}",
                         "tool_choice")
    return [{"type": "function", "function": t["function"]} for t in tools], mode


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def constraint(tools: list[dict], mode: str) -> StructuredOutputsParams | None:
    """The structured-output constraint a mode imposes (None for none / auto)."""
    if mode.startswith("named:"):
        name = mode.split(":", 1)[1]
        return StructuredOutputsParams(json=next(_parameters(t) for t in tools if t["function"]["name"] == name))
    if mode == "required":
        one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
                "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": one}})
    return None


def calls_from_constrained(mode: str, text: str) -> list[ToolCall]:
    """The calls of a `required` or named output (already valid by construction, unless it
    was cut off by the length limit: then there are none)."""
    if mode.startswith("named:"):
        try:
            json.loads(text)
        except ValueError:
            return []
        return [ToolCall(mode.split(":", 1)[1], text)]
    try:
        json.loads(text)
    except ValueError:
        return []
    # The arguments as the model wrote them (as streamed: runtime/tool_stream.py).
    return [ToolCall(c.name, c.final_arguments()) for c in scan_array(text)]


class HermesParser:
    """Hermes / Qwen style: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
    the text outside the calls is the content (trailing whitespace dropped when there are
    calls). Arguments are the model's JSON text of the value (`tool_stream.scan_call`)."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        content, scans = self._split(text, final=True)
        if not scans:
            return text, []
        return content, [ToolCall(s.name, s.final_arguments()) for s in scans]

    def partial(self, text: str) -> tuple[str, list[CallScan]]:
        """Content and calls of a prefix of the output, each a prefix of the final parse's."""
        return self._split(text, final=False)

    def _split(self, text: str, final: bool) -> tuple[str, list[CallScan]]:
        parts, scans, pos = [], [], 0
        while True:
            k = text.find(self.OPEN, pos)
            if k < 0:
                tail = text[pos:]
                if not final:   # hold back what could still open a tag
                    for n in range(min(len(tail), len(self.OPEN) - 1), 0, -1):
                        if tail.endswith(self.OPEN[:n]):
                            tail = tail[:-n]
                            break
                parts.append(tail)
                break
            parts.append(text[pos:k])
            e = text.find(self.CLOSE, k)
            body = text[k + len(self.OPEN): len(text) if e < 0 else e].strip()
            if e < 0:
                if not final and body.startswith("{"):     # an open call: what it holds so far
                    scans.append(scan_call(body, 0))
                elif final:
                    parts.append(text[k:])
                break
            try:
                obj = json.loads(body)
            except ValueError:
                obj = None
            scan = scan_call(body, 0) if isinstance(obj, dict) else None
            if scan is not None and isinstance(scan.name, str):
                scans.append(scan)
            else:                              # not a call after all: it stays content
                parts.append(text[k:e + len(self.CLOSE)])
            pos = e + len(self.CLOSE)
        content = "".join(parts)
        return (content.rstrip() if scans or not final else content), scans


PARSERS = {p.name: p for p in (HermesParser,)}


def get_parser(name: str | None):
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]()


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls as HF templates take them: arguments as objects, not JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
