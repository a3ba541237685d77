"""/v1/responses (stateless) with the official openai client: text, streaming events,
structured text.format, function tools and a call's output fed back; what a stateless
server cannot do is a 400 naming the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serving import running_server, tiny_chat_spec

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    spec = tiny_chat_spec(tmp_path_factory.mktemp("responses"))
    with running_server(spec) as (proc, base):
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    assert "Traceback" not in proc.stdout.read()


def test_text_equals_chat(client):
    r = client.responses.create(model="tiny-chat", input="Hello there", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="tiny-chat", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens


def test_stream_events(client):
    kwargs = dict(model="tiny-chat", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                  max_output_tokens=10, temperature=0)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                        "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == client.responses.create(**kwargs).output_text == events[-1].response.output_text


def test_structured_format_and_tools(client):
    r = client.responses.create(model="tiny-chat", input="Where?", max_output_tokens=60, temperature=1.0, extra_body={"seed": 2},
                                text={"format": {"type": "json_schema", "name": "place", "schema": WEATHER,
                                                 "strict": True}})
    if r.status == "completed":
        jsonschema.validate(json.loads(r.output_text), WEATHER)
    called = client.responses.create(model="tiny-chat", input="Weather in Paris?", tools=[TOOL],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                     temperature=1.0, extra_body={"seed": 1})
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = client.responses.create(model="tiny-chat", max_output_tokens=4, temperature=0, tools=[TOOL],
                                     tool_choice="none", input=[
                                         {"role": "user", "content": "Weather in Paris?"},
                                         {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                          "arguments": call.arguments},
                                         {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.output and follow.output[0].type == "message"


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
])
def test_stateless_limits(client, extra, param):
    kwargs = {"model": "tiny-chat", "input": "hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kwargs)
    assert e.value.body["param"] == param, e.value.body
