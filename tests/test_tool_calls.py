"""Tool calling on a real server (the official openai client): a named function and
`required` constrain the output to valid calls, streamed or not; a call's result goes back
as a `tool` message through the chat template; `auto` parses hermes-style calls; errors
name the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from runtime.tool_calls import HermesParser, calls_from_constrained, check_tools
from runtime.limits import ParamError
from tests.serving import running_server, tiny_chat_spec

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    spec = tiny_chat_spec(tmp_path_factory.mktemp("tools"))
    with running_server(spec, "--tool-call-parser", "hermes") as (proc, base):
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    assert "Traceback" not in proc.stdout.read()


def test_named_function_round_trip(client):
    r = client.chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, max_tokens=60, seed=1,
                                       temperature=1.0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    followup = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    r2 = client.chat.completions.create(model="tiny-chat", messages=followup, tools=TOOLS, tool_choice="none",
                                        max_tokens=5, temperature=0, extra_body={"return_token_ids": True})
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content is not None
    from transformers import AutoTokenizer

    from models.embedded import ensure_embedded
    prompt = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m")).decode(r2.model_extra["prompt_token_ids"])
    assert "sunny, 24 C" in prompt


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_valid_calls(client, stream):
    kwargs = dict(model="tiny-chat", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
                  temperature=1.0, seed=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        finals = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert len(finals) == 1
        reason = finals[0].finish_reason
        # Fragments as they stream: a call's first delta has index, id and name, then arguments.
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        calls = [tc for tc in deltas if tc.id is not None]
        assert [tc.index for tc in calls] == list(range(len(calls))) and all(tc.function.name for tc in calls)
        for tc in deltas:
            if tc.id is None:
                calls[tc.index].function.arguments += tc.function.arguments
        assert len(deltas) > len(calls) + 2, "arguments must arrive in fragments"
        whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        assert [(a.function.name, a.function.arguments) for a in calls] == \
            [(b.function.name, b.function.arguments) for b in whole]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, reason = choice.message.tool_calls, choice.finish_reason
    assert reason == "tool_calls" and calls
    for call in calls:
        schema = WEATHER if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_errors_name_the_field(client, tmp_path):
    bad = [(dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
           (dict(tool_choice="sometimes"), "tool_choice"),
           (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
           (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format")]
    for extra, param in bad:
        kwargs = {"model": "tiny-chat", "messages": ASK, "max_tokens": 4, "tools": TOOLS, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kwargs)
        assert e.value.body["param"] == param, e.value.body


def test_auto_needs_a_parser(tmp_path):
    with running_server(tiny_chat_spec(tmp_path)) as (proc, base):
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="tool parser"):
            c.chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, max_tokens=4)
        ok = c.chat.completions.create(model="tiny-chat", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert ok.choices[0].message.tool_calls is None


def test_hermes_parser():
    p = HermesParser()
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
            '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    assert p.parse("no calls <tool_call>not json</tool_call>") == ("no calls <tool_call>not json</tool_call>", [])
    assert calls_from_constrained("required", '[{"name": "ping", "parameters": {}}]')[0].name == "ping"
    assert calls_from_constrained("named:ping", '{"a": ') == []       # cut off: no call
    with pytest.raises(ParamError, match="tool_choice: needs tools"):
        check_tools(None, "required")
