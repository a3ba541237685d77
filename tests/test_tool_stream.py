"""Streamed tool calls (runtime/tool_stream.py): fed the output in pieces of every size, the
deltas accumulate (as the openai client does) into exactly the non-streamed parse: the same
content, names and argument strings; each call's first delta has its index, id, type and
name, and argument fragments arrive while the call is still open."""
from __future__ import annotations

import json

import pytest

from runtime.tool_calls import HermesParser, calls_from_constrained
from runtime.tool_stream import ToolCallStream, scan_call

HERMES = ('Let me check {braces} first.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"",'
          ' "opts": {"days": [1, 2]}, "u": null}}\n</tool_call>\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
          '<tool_call>{"arguments": "{\\"q\\": 1}", "name": "search"}</tool_call>  \n')
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}, {"name": "ping", "parameters": {}}]'


def _accumulate(stream: ToolCallStream, text: str, size: int, final) -> tuple[str, list[dict], list[dict]]:
    content, calls, firsts = "", [], []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    deltas = [stream.feed(p) for p in pieces[:-1]]
    stream.text += pieces[-1]
    deltas.append(stream.finish(*final))
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):
                firsts.append(tc)
                calls.append({"name": tc["function"]["name"], "arguments": ""})
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, calls, firsts


@pytest.mark.parametrize("size", [1, 2, 3, 7, 40, 1000])
def test_hermes_stream_equals_the_parse(size):
    parser = HermesParser()
    content, calls = parser.parse(HERMES)
    assert [c.name for c in calls] == ["get_weather", "ping", "search"]
    assert json.loads(calls[0].arguments) == {"city": 'Pa}ris "x"', "opts": {"days": [1, 2]}, "u": None}
    assert calls[2].arguments == '{"q": 1}' and content == "Let me check {braces} first."
    got_content, got, firsts = _accumulate(ToolCallStream("auto", parser), HERMES, size, (content, calls))
    assert got_content == content
    assert got == [{"name": c.name, "arguments": c.arguments} for c in calls]
    assert [f["index"] for f in firsts] == [0, 1, 2] and all(f["id"].startswith("call_") and f["type"] == "function"
                                                             for f in firsts)


def test_arguments_stream_while_the_call_is_open():
    s = ToolCallStream("auto", HermesParser())
    head = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    d = s.feed(head)
    assert d["content"] == "Hi" and d["tool_calls"] == [{"index": 0, "id": d["tool_calls"][0]["id"], "type": "function",
                                                          "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]
    assert s.feed('ris"}') == {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}
    assert s.feed("}\n</tool_") == {}          # the outer brace and a partial tag are not arguments
    assert s.feed("call> and") == {"content": "  and"}     # the space held back after "Hi", then " and"


def test_no_calls_stream_the_text_unchanged():
    parser = HermesParser()
    text = "  plain answer with <tool_ and < signs \n"
    content, calls = parser.parse(text)
    assert (content, calls) == (text, [])
    for size in (1, 4, 100):
        assert _accumulate(ToolCallStream("auto", parser), text, size, (content, calls))[:2] == (text, [])


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_required_and_named_streams_equal_the_parse(size):
    calls = calls_from_constrained("required", REQUIRED)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome", "days": 3}'), ("ping", "{}")]
    _, got, _ = _accumulate(ToolCallStream("required"), REQUIRED, size, (None, calls))
    assert got == [{"name": c.name, "arguments": c.arguments} for c in calls]
    args = '{"city": "Oslo", "days": 1}'
    named = calls_from_constrained("named:get_weather", args)
    _, got, _ = _accumulate(ToolCallStream("named:get_weather"), args, size, (None, named))
    assert got == [{"name": "get_weather", "arguments": args}]


def test_scan_call_stops_where_the_text_does():
    assert scan_call('{"name": "f", "argu', 0).name == "f"
    part = scan_call('{"name": "f", "arguments": {"a": "}"', 0)
    assert part.args == '{"a": "}"' and not part.args_done and part.partial_arguments() == '{"a": "}"'
    obj = '{"arguments": [1, {"b": 2}], "name": "g"}'
    whole = scan_call(obj + " tail", 0)
    assert (whole.name, whole.args, whole.end) == ("g", '[1, {"b": 2}]', len(obj))
