"""Tool calls as the model streams them: OpenAI's `delta.tool_calls` fragments.

The first delta of call i carries its `index`, `id`, `type` and `function.name` (and the
arguments written so far); later deltas carry `{"index": i, "function": {"arguments": ...}}`
fragments. Arguments are the model's own JSON text (the raw span of the call's `arguments`
value), both here and in a non-streamed response (`tool_calls.py` scans with the same
`scan_call`), so the concatenated fragments equal the non-streamed arguments exactly:
while a call is open, what is sent is the text from the value's first character up to the
end of what has arrived, never past the value's closing bracket; at the finish the final
parse is authoritative and only its remainder is sent.

Content outside the calls streams as it arrives, minus a tail that could still open a
`<tool_call>` tag and trailing whitespace (the non-streamed content drops trailing
whitespace when there are calls; without calls it is flushed at the finish).

Known limit (vLLM's too): a call whose header was sent but that turns out not to parse (the
model never closes the tag, or writes invalid JSON) cannot be taken back; the non-streamed
response would show that text as content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from json.decoder import scanstring

_WS = " \t\n\r"
ARG_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class CallScan:
    """What a (possibly incomplete) `{"name": ..., "arguments": ...}` object holds so far."""
    name: str | None = None
    args: str | None = None     # raw text of the arguments value, as far as it has arrived
    args_done: bool = False
    end: int | None = None      # index past the object's closing brace, once complete

    def final_arguments(self) -> str:
        """The call's arguments as a JSON string: the raw object text, a string value decoded
        (the model already wrote JSON text), "{}" when absent."""
        if self.args is None:
            return "{}"
        if self.args.startswith('"'):
            return json.loads(self.args)
        return self.args

    def partial_arguments(self) -> str:
        """What may be sent of the arguments now (always a prefix of `final_arguments`)."""
        if self.args_done:
            return self.final_arguments()
        return self.args if self.args and self.args[0] in "{[" else ""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """Index past the JSON value that starts at text[i]; None while it is incomplete."""
    c = text[i]
    if c in "{[":
        depth, in_str, esc = 0, False, False
        for j in range(i, len(text)):
            ch = text[j]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    if c == '"':
        try:
            return scanstring(text, i + 1)[1]
        except ValueError:
            return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) else None     # a scalar is complete once a delimiter follows


def scan_call(text: str, pos: int, arg_keys=ARG_KEYS) -> CallScan:
    """Scan the object that opens at text[pos] ('{'): its first `name` string and the raw
    text of its first arguments value, as far as the text goes."""
    scan = CallScan()
    i = _skip_ws(text, pos + 1)
    while i < len(text):
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            return scan
        try:
            key, i = scanstring(text, i + 1)
        except ValueError:
            return scan
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] != ":":
            return scan
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        end = _value_end(text, i)
        if key in arg_keys and scan.args is None:
            scan.args, scan.args_done = text[i:len(text) if end is None else end], end is not None
        elif key == "name" and scan.name is None and end is not None and text[i] == '"':
            scan.name = json.loads(text[i:end])
        if end is None:
            return scan
        i = _skip_ws(text, end)
    return scan


def scan_array(text: str, arg_keys=("parameters",)) -> list[CallScan]:
    """The calls of a `tool_choice: required` output, `[{"name", "parameters"}, ...]`, so far."""
    calls = []
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return calls
    i = _skip_ws(text, i + 1)
    while i < len(text) and text[i] == "{":
        scan = scan_call(text, i, arg_keys)
        calls.append(scan)
        if scan.end is None:
            break
        i = _skip_ws(text, scan.end)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    return calls


class ToolCallStream:
    """One choice's streamed deltas under a tool mode ("auto", "required", "named:<fn>").
    `feed` takes the choice's new text and returns its delta (maybe empty); `finish` takes
    the final parse (content, calls) and returns the rest."""

    def __init__(self, mode: str, parser=None):
        self.mode, self.parser = mode, parser
        self.text = ""
        self.sent_content = ""
        self.sent: list[list[str]] = []          # per call: [id, arguments sent so far]

    def feed(self, delta: str) -> dict:
        self.text += delta
        if self.mode.startswith("named:"):
            calls = [CallScan(self.mode.split(":", 1)[1], self.text, False)]
            return self._diff(None, [(c.name, c.partial_arguments()) for c in calls])
        if self.mode == "required":
            return self._diff(None, [(c.name, c.partial_arguments()) for c in scan_array(self.text)])
        content, calls = self.parser.partial(self.text)
        return self._diff(content, [(c.name, c.partial_arguments()) for c in calls])

    def finish(self, content: str | None, calls: list) -> dict:
        return self._diff(content, [(c.name, c.arguments) for c in calls])

    def _diff(self, content: str | None, calls: list[tuple[str | None, str]]) -> dict:
        out: dict = {}
        if content and content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            out["content"] = content[len(self.sent_content):]
            self.sent_content = content
        deltas = []
        for j, (name, args) in enumerate(calls):
            if j == len(self.sent):
                if name is None:          # a call's first delta needs its name
                    break
                self.sent.append([f"call_{uuid.uuid4().hex[:24]}", ""])
                deltas.append({"index": j, "id": self.sent[j][0], "type": "function",
                               "function": {"name": name, "arguments": ""}})
            done = self.sent[j][1]
            if len(args) > len(done) and args.startswith(done):
                if deltas and deltas[-1]["index"] == j:
                    deltas[-1]["function"]["arguments"] = args[len(done):]
                else:
                    deltas.append({"index": j, "function": {"arguments": args[len(done):]}})
                self.sent[j][1] = args
        if deltas:
            out["tool_calls"] = deltas
        return out
