"""Structured outputs (xgrammar): whatever the weights, constrained output is valid.

On a random-weight model (the tiny-chat spec: seeded weights, SmolLM2's real tokenizer) every
one of 20 JSON schemas gives output that parses and validates, or stops at `length`; choices,
regexes and EBNF grammars hold exactly; n > 1 samples, chunked prefill and preemption keep
each sample's matcher right; the real SmolLM2 follows schemas too; a bad grammar is a
ParamError naming the field."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from runtime import LLM, SamplingParams
from runtime.limits import ParamError
from runtime.structured_outputs import StructuredOutputsParams as SO
from tests.serving import ROOT, running_server, tiny_chat_spec
from tests.zoo_parity import tight_pool_blocks

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    obj({"name": S}),
    obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"price": {"type": "number", "minimum": 0.5, "maximum": 99.5}}),
    obj({"ok": B, "count": I}),
    obj({"colour": {"enum": ["red", "green", "blue"]}}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"point": obj({"x": I, "y": I})}),
    obj({"user": obj({"name": {"type": "string", "maxLength": 6}, "roles": {"type": "array", "items": {
        "enum": ["admin", "dev"]}, "maxItems": 2}})}),
    {"type": "array", "items": I, "minItems": 2, "maxItems": 4},
    obj({"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}}),
    obj({"a": S, "b": {"type": ["integer", "null"]}}),
    obj({"kind": {"const": "event"}, "at": I}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}}),
    obj({"opt": S}, required=[]),
    obj({"score": {"type": "integer", "minimum": -5, "maximum": 5}, "label": {"enum": ["lo", "hi"]}}),
    {"type": "string", "enum": ["yes", "no"]},
    obj({"nested": obj({"deeper": obj({"leaf": B})})}),
    obj({"items": {"type": "array", "items": obj({"sku": {"type": "string", "maxLength": 8},
                                                  "qty": {"type": "integer", "minimum": 1}}), "maxItems": 2}}),
    obj({"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    obj({"choice": {"anyOf": [I, {"type": "string", "maxLength": 3}]}}),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return LLM(tiny_chat_spec(tmp_path_factory.mktemp("so")), max_model_len=256)


def _check_json(finish_reason: str, text: str, schema) -> bool:
    """Valid and complete, or cut off by the length limit (a random model may ramble)."""
    if finish_reason == "length":
        return False
    jsonschema.validate(json.loads(text), schema)
    return True


def test_twenty_schemas_on_random_weights(tiny):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=SO(json=s))
              for i, s in enumerate(SCHEMAS)]
    outs = tiny.generate(["Reply in JSON:"] * len(SCHEMAS), params, use_tqdm=False)
    complete = sum(_check_json(o.outputs[0].finish_reason, o.outputs[0].text, s) for o, s in zip(outs, SCHEMAS))
    assert complete >= 15, complete          # most finish well inside 120 tokens
    unconstrained = tiny.generate("Reply in JSON:", SamplingParams(temperature=1.0, seed=0, max_tokens=30),
                                  use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError):          # what the same model writes unconstrained
        json.loads(unconstrained)
    stats = tiny.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("so, check", [
    (SO(choice=["alpha", "beta", "gamma delta"]), lambda t: t in ("alpha", "beta", "gamma delta")),
    (SO(regex=r"[A-Z][a-z]{2,5}-\d{3}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", t)),
    (SO(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_choice_regex_grammar_json_object(tiny, so, check):
    """Finished outputs match exactly; every output, finished or cut off by `length` (free
    JSON keys can run on forever on random weights), is a prefix the grammar accepts."""
    outs = tiny.generate(["Go:"] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=so)
                                       for s in range(6)], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert all(check(t) for t in texts), texts
    assert len(texts) >= (0 if so.json_object else 5)
    for o in outs:
        assert tiny.engine.grammars.matcher(so).accept_string(o.outputs[0].text), o.outputs[0].text


def test_samples_chunks_and_preemption_keep_each_matcher(tmp_path):
    """n = 4 samples (forked matchers), 13-token prefill chunks and a pool small enough to
    preempt: every sample still ends valid, and equals the same request run alone."""
    spec = tiny_chat_spec(tmp_path)
    schema = SCHEMAS[7]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=80, structured_outputs=SO(json=schema))
    prompts = ["Reply in JSON: " + "x " * k for k in (3, 40, 75)]
    tight = LLM(spec, max_model_len=160, max_num_batched_tokens=13, num_kv_blocks=tight_pool_blocks(spec, 160, 13))
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.kv_cache_stats()["num_preemptions"] > 0
    alone = LLM(spec, max_model_len=160).generate(prompts, params, use_tqdm=False)
    for o, a in zip(outs, alone):
        assert [c.text for c in o.outputs] == [c.text for c in a.outputs]
        assert sum(_check_json(c.finish_reason, c.text, schema) for c in o.outputs) >= 3
    stats = tight.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def _ask_every_schema(base: str, model: str, show_schema: bool, **sampling) -> list:
    """Each of SCHEMAS as a strict response_format json_schema through the official openai
    client, 8 requests at once (the engine batches constrained rows); the choices in order.
    `show_schema`: the prompt also spells the schema out (for a model that can read it)."""
    import openai
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

    def ask(i_schema):
        i, schema = i_schema
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        content = f"Reply with one JSON value matching this schema: {json.dumps(schema)}" if show_schema \
            else "Reply in JSON:"
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                              response_format=fmt, seed=i, **sampling).choices[0]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(ask, enumerate(SCHEMAS)))


def test_real_smollm2_follows_every_schema_over_http():
    """A real `runtime.serve zoo/smollm2-135m.yaml`, greedy: all 20 end with `stop` and validate."""
    with running_server(ROOT / "zoo" / "smollm2-135m.yaml", "--max-model-len", "512") as (_, base):
        choices = _ask_every_schema(base, "smollm2-135m", True, temperature=0, max_tokens=200)
    for choice, schema in zip(choices, SCHEMAS):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_random_weights_emit_valid_json_or_stop_at_the_length_over_http(tmp_path):
    """Random weights sampled at temperature 1: each answer validates, or is cut by the length limit."""
    with running_server(tiny_chat_spec(tmp_path)) as (_, base):
        choices = _ask_every_schema(base, "tiny-chat", False, temperature=1.0, max_tokens=120)
    assert sum(_check_json(c.finish_reason, c.message.content, s) for c, s in zip(choices, SCHEMAS)) >= 15


@pytest.mark.parametrize("so", [SO(regex="(unclosed"), SO(grammar="root ::= missing_rule"),
                                SO(json={"type": "object", "properties": {"a": {"type": "frob"}}})])
def test_bad_grammars_are_param_errors(tiny, so):
    with pytest.raises(ParamError, match=r"structured_outputs: (regex|grammar|json) is not supported or invalid"):
        tiny.generate("x", SamplingParams(structured_outputs=so), use_tqdm=False)
    with pytest.raises(ParamError, match="exactly one"):
        SamplingParams(structured_outputs=SO(regex="a", choice=["b"]))
    stats = tiny.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_waiting"] == 0
