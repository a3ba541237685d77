"""Tests of vLLM's suite that are not applicable on SmolLM2-135M because their assertion needs
a capable model, not a conforming server (it answers "1 + 1 = 2" where a test wants "2",
ends at EOS where a test wants more text, and so on). `conformance_plugin` skips each with
the reason "not applicable: needs a capable model: <what it expects>".

An entry goes in only after the server was checked on that request: the response's shape and
fields are right, and where a constraint (ignore_eos, min_tokens, a grammar, tool_choice) can
force the expected answer, the server then gives it. The README's conformance section lists
them. Keyed by the test id under tests/entrypoints/openai/, with or without its parameters.
"""
from __future__ import annotations

NEEDS_CAPABLE_MODEL: dict[str, str] = {
    # SmolLM2 answers "1 + 1 = 2" (greedy); the message is right in shape, and a [0-9]+ regex
    # constraint gives digits only ("11": the model's guess, not the server's).
    "chat_completion/test_chat.py::test_complex_message_content":
        'expects the exact answer "2" to "what is 1+1? please provide the result without any other text"',
    # Valid JSON objects come back (they parse); SmolLM2 writes other keys than "result".
    "chat_completion/test_chat.py::test_response_format_json_object":
        'expects the object {"result": 2} for "what is 1+1?"',
    # `result` is optional in the schema: at temperature 1 SmolLM2 gives {} about as often as
    # {"result": 2}; with `result` required the server gives {"result": 2}.
    "chat_completion/test_chat.py::test_response_format_json_schema":
        'expects the model to fill the optional "result" with 2 on every one of two samples',
    # The output is the schema's JSON when the model ends it (113 tokens in the check); at
    # temperature 1 SmolLM2 can fill a string up to the 1000-token limit (finish "length").
    "chat_completion/test_chat.py::test_structured_outputs_json_chat":
        "expects the model to close the JSON within 1000 tokens and change name and age when asked",
    # Entries are the top-k plus the prompt token (vLLM's rule); SmolLM2 ranks token 3 ("You")
    # 6th, so k=1 gives two entries where the test's model had it first.
    "chat_completion/test_chat.py::test_more_than_one_prompt_logprobs_chat":
        "expects prompt token 3 to be the model's top-1 guess (one entry for prompt_logprobs=1)",
    # SmolLM2 ends "What is an LLM?" with EOS at once (finish "stop", no text); with
    # ignore_eos the 5 tokens come with finish "length".
    "completion/test_completion.py::test_completion_streaming":
        'expects 5 tokens of text before EOS for "What is an LLM?"',
    # Two of the three seeded samples are EOS at once (empty); with min_tokens=2 all three
    # are distinct texts.
    "completion/test_completion.py::test_parallel_no_streaming":
        'expects three non-empty distinct samples (n=3, seed 42) for "What is an LLM?"',
    "completion/test_completion.py::test_parallel_streaming":
        'expects three non-empty distinct samples (n=3, seed 42) for "What is an LLM?"',
    # SmolLM2 answers with EOS at once, so the text (special tokens skipped) cannot end with
    # the decoded "<|im_end|>"; with min_tokens=5 the ids, echo and logprob tokens line up.
    "test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs":
        "expects text before EOS for a raw completion prompt (SmolLM2 ends at once)",
    # Both spellings of the message render to the same prompt and give the same greedy text
    # (checked with max_tokens 300); SmolLM2 does not end it, and with no max_tokens the test
    # runs to the 8192-token context and times out.
    "chat_completion/test_chat.py::test_custom_role":
        'expects the model to end its greedy answer to "what is 1+1?" (the test sets no max_tokens)',
    # The echo is right (the reply starts with the saying with echo on, not with it off: checked,
    # and tests/test_server_vllm_conformance.py); at temperature 1 SmolLM2 ends the saying after
    # about 100 tokens in one sample and runs to the 4080-token limit ("length") in another.
    "chat_completion/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message":
        "expects the model to end the continued saying (finish \"stop\") on every sample",
    # The same saying continued through --root-path with the right API key (the wrong-key cases
    # run): the routes answer under both prefixes; whether the sample ends is the model's.
    "chat_completion/test_root_path.py::test_chat_session_root_path_with_api_key[test_case2]":
        "expects the model to end the continued saying (finish \"stop\") on every sample",
    "chat_completion/test_root_path.py::test_chat_session_root_path_with_api_key[test_case3]":
        "expects the model to end the continued saying (finish \"stop\") on every sample",
    # SmolLM2's chat template has no tools section and the model was not trained for them:
    # it answers in prose; tool_choice "required" gives get_weather({"location": "Paris", ...}).
    "test_return_token_ids.py::test_chat_completion_with_tool_use":
        "expects a tool-trained model to call get_weather unprompted in hermes <tool_call> form",
}


def capable_model_reason(test_id: str) -> str | None:
    """The skip reason of a listed test (`test_id` a pytest node id or a path::name under the
    checkout), else None."""
    rel = test_id.split("tests/entrypoints/openai/", 1)[-1]
    why = NEEDS_CAPABLE_MODEL.get(rel) or NEEDS_CAPABLE_MODEL.get(rel.split("[", 1)[0])
    return None if why is None else f"not applicable: needs a capable model: {why}"
