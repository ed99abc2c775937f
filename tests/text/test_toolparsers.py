"""Tool calls and tool results recovered from decoded text: hermes, qwen3_coder, gpt_oss."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from trace_proxy.text.toolparsers import (
    DEFAULT_PARSER,
    PARSERS,
    ParsedResponse,
    ParsedToolCall,
    ToolCallParser,
    Turn,
    get_parser,
)

HERMES = get_parser("hermes")
CODER = get_parser("qwen3_coder")
OSS = get_parser("gpt_oss")


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def call(name: str, arguments: Any) -> ParsedToolCall:
    return ParsedToolCall(name=name, arguments=dumps(arguments))


# ---------------------------------------------------------------------------------------------
# Registry


def test_registry_names_and_default() -> None:
    assert set(PARSERS) == {"hermes", "qwen3_coder", "gpt_oss"}
    assert DEFAULT_PARSER == "hermes"
    for name, parser in PARSERS.items():
        assert parser.name == name
        assert get_parser(name) is parser
        checked: ToolCallParser = parser  # each satisfies the protocol
        assert callable(checked.parse_response) and callable(checked.tool_results)
        assert callable(checked.turns)


def test_get_parser_accepts_vllm_names() -> None:
    assert get_parser("openai") is OSS
    assert get_parser("gpt-oss") is OSS
    assert get_parser("qwen3_xml") is CODER
    assert get_parser("Hermes") is HERMES


def test_get_parser_unknown_lists_known_names() -> None:
    with pytest.raises(ValueError) as info:
        get_parser("pythonic")
    message = str(info.value)
    assert "pythonic" in message
    for name in ("hermes", "qwen3_coder", "gpt_oss"):
        assert name in message


# ---------------------------------------------------------------------------------------------
# hermes


def hermes_block(name: str, arguments: Any) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {dumps(arguments)}}}\n</tool_call>'


def test_hermes_single_call() -> None:
    text = hermes_block("get_weather", {"city": "Paris"}) + "<|im_end|>"
    assert HERMES.parse_response(text) == ParsedResponse(
        content=None,
        reasoning=None,
        calls=[call("get_weather", {"city": "Paris"})],
        unparsed=[],
    )


def test_hermes_parallel_calls_with_text_around() -> None:
    text = (
        "Let me look both up.\n"
        + hermes_block("get_weather", {"city": "Paris"})
        + "\n"
        + hermes_block("get_time", {"tz": "Europe/Paris", "format": 24})
        + "\nDone asking.<|im_end|>\n"
    )
    parsed = HERMES.parse_response(text)
    assert parsed.calls == [
        call("get_weather", {"city": "Paris"}),
        call("get_time", {"tz": "Europe/Paris", "format": 24}),
    ]
    assert parsed.content == "Let me look both up.\nDone asking."
    assert parsed.reasoning is None
    assert parsed.unparsed == []


def test_hermes_normalises_the_arguments_json() -> None:
    text = (
        '<tool_call>\n{"name":"f","arguments":{ "a" :1,"b":[true,null], "c": "\\u00e9"}}'
        "\n</tool_call>"
    )
    assert HERMES.parse_response(text).calls == [call("f", {"a": 1, "b": [True, None], "c": "é"})]


def test_hermes_arguments_written_as_a_string_are_kept() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    assert HERMES.parse_response(text).calls == [ParsedToolCall("f", '{"a": 1}')]


def test_hermes_call_without_arguments() -> None:
    text = '<tool_call>\n{"name": "now"}\n</tool_call>'
    assert HERMES.parse_response(text).calls == [ParsedToolCall("now", "{}")]


def test_hermes_reasoning_before_calls() -> None:
    text = (
        "<think>\nThe user wants the weather.\nI should call the tool.\n</think>\n\n"
        + hermes_block("get_weather", {"city": "Paris"})
        + "<|im_end|>"
    )
    parsed = HERMES.parse_response(text)
    assert parsed.reasoning == "The user wants the weather.\nI should call the tool."
    assert parsed.content is None
    assert parsed.calls == [call("get_weather", {"city": "Paris"})]


def test_hermes_reasoning_opened_by_the_prompt() -> None:
    # Thinking templates put "<think>\n" in the prompt: the response has only "</think>".
    text = "Think first.\n</think>\n\nThe answer is 4."
    parsed = HERMES.parse_response(text)
    assert parsed.reasoning == "Think first."
    assert parsed.content == "The answer is 4."


def test_hermes_truncated_reasoning_and_empty_thinking() -> None:
    parsed = HERMES.parse_response("<think>\nStill thinking about it")
    assert parsed.reasoning == "Still thinking about it"
    assert parsed.content is None
    parsed = HERMES.parse_response("<think>\n\n</think>\n\nHi!<|im_end|>")
    assert parsed.reasoning is None
    assert parsed.content == "Hi!"


def test_hermes_tool_call_ends_unclosed_reasoning() -> None:
    # As vLLM's Qwen3 grammar: <tool_call> inside an open <think> ends the reasoning.
    text = "<think>\nneed weather\n" + hermes_block("get_weather", {"city": "Oslo"})
    parsed = HERMES.parse_response(text)
    assert parsed.reasoning == "need weather"
    assert parsed.calls == [call("get_weather", {"city": "Oslo"})]


def test_hermes_plain_text_and_empty() -> None:
    assert HERMES.parse_response("Hello there.<|im_end|>") == ParsedResponse(
        "Hello there.", None, [], []
    )
    assert HERMES.parse_response("") == ParsedResponse(None, None, [], [])
    assert HERMES.parse_response("  \n<|im_end|>") == ParsedResponse(None, None, [], [])


def test_hermes_truncated_call_is_unparsed() -> None:
    first = hermes_block("get_weather", {"city": "Paris"})
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ber'
    parsed = HERMES.parse_response("Checking.\n" + first + "\n" + cut)
    assert parsed.calls == [call("get_weather", {"city": "Paris"})]
    assert parsed.content == "Checking."
    [bad] = parsed.unparsed
    assert bad.raw == cut
    assert "</tool_call>" in bad.error and "truncated" in bad.error


def test_hermes_unclosed_call_with_complete_json_is_still_unparsed() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n'
    [bad] = HERMES.parse_response(text).unparsed
    assert bad.raw == text.rstrip()
    assert "JSON inside is complete" in bad.error
    assert HERMES.parse_response(text).calls == []


def test_hermes_call_cut_and_started_over() -> None:
    text = (
        '<tool_call>\n{"name": "f", "argu<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )
    parsed = HERMES.parse_response(text)
    assert parsed.calls == [call("f", {})]
    [bad] = parsed.unparsed
    assert bad.raw == '<tool_call>\n{"name": "f", "argu'
    assert "not closed" in bad.error


def test_hermes_arguments_mentioning_tool_call_tags() -> None:
    args = {"code": "print('<tool_call>')"}
    assert HERMES.parse_response(hermes_block("run", args)).calls == [call("run", args)]


def test_hermes_invalid_json_is_unparsed_and_others_still_parse() -> None:
    bad_block = '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'
    text = bad_block + "\n" + hermes_block("g", {"b": 2})
    parsed = HERMES.parse_response(text)
    assert parsed.calls == [call("g", {"b": 2})]
    [bad] = parsed.unparsed
    assert bad.raw == bad_block
    assert bad.error.startswith("invalid JSON in tool call: ")
    assert "line 1 column" in bad.error


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ('<tool_call>\n["f", {}]\n</tool_call>', "not an object"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '"name"'),
        ("<tool_call>\n\n</tool_call>", "empty"),
        ('<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>', "NaN"),
    ],
)
def test_hermes_malformed_calls(block: str, needle: str) -> None:
    parsed = HERMES.parse_response(block)
    assert parsed.calls == []
    [bad] = parsed.unparsed
    assert bad.raw == block
    assert needle in bad.error


def test_hermes_non_ascii_arguments() -> None:
    args = {"city": "Zürich", "note": "東京 — ☀️", "emoji": "🙂"}
    [found] = HERMES.parse_response(hermes_block("get_weather", args)).calls
    assert found.arguments == '{"city": "Zürich", "note": "東京 — ☀️", "emoji": "🙂"}'
    assert json.loads(found.arguments) == args


def test_hermes_tool_results_from_added_text() -> None:
    added = (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        '{"temp_c": 18}\n</tool_response>\n<tool_response>\n'
        "Error when executing tool: timeout\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert HERMES.tool_results(added) == [
        '{"temp_c": 18}',
        "Error when executing tool: timeout",
    ]
    assert HERMES.tool_results("<|im_end|>\n<|im_start|>user\nthanks<|im_end|>\n") == []


def test_hermes_tool_results_keep_the_results_own_whitespace() -> None:
    added = "\n<|im_start|>user\n<tool_response>\n\n  indented\n\n</tool_response><|im_end|>\n"
    assert HERMES.tool_results(added) == ["\n  indented\n"]


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Web search.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
]


@pytest.mark.parametrize("content", [None, "Let me check both cities."])
@pytest.mark.parametrize("stop_token_in_output", [True, False])
def test_hermes_results_from_a_real_two_turn_rendering(
    qwen_tokenizer: Any, content: str | None, stop_token_in_output: bool
) -> None:
    """Render turn 1 and turn 2 with the real tokenizer's chat template, split turn 2's prompt
    after turn 1's response (in token ids, as the proxy does) and get the results back."""
    tok = qwen_tokenizer
    turn1 = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris and Zürich? Also search for café hours."},
    ]
    arguments = ['{"city": "Paris"}', '{"city": "Zürich", "unit": "°C"}', '{"q": "café hours"}']
    names = ["get_weather", "get_weather", "search"]
    assistant = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": a}}
            for k, (n, a) in enumerate(zip(names, arguments, strict=True))
        ],
    }
    results = [
        '{"temp_c": 18, "sky": "clear"}',
        "Zürich: 12 °C\nwind 20 km/h",
        "\n1. Café de Flore — 7:30-1:30\n2. Les Deux Magots\n",
    ]
    tool_messages = [
        {"role": "tool", "tool_call_id": f"call_{k}", "content": r} for k, r in enumerate(results)
    ]

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        text: str = tok.apply_chat_template(
            messages, tools=WEATHER_TOOLS, tokenize=False, add_generation_prompt=generation_prompt
        )
        return text

    prompt1 = render(turn1, True)
    with_reply = render([*turn1, assistant], False)
    assert with_reply.startswith(prompt1) and with_reply.endswith("<|im_end|>\n")
    response_text = with_reply[len(prompt1) : -len("\n")]  # the model stops at <|im_end|>
    if not stop_token_in_output:
        response_text = response_text[: -len("<|im_end|>")]
    prompt2 = render([*turn1, assistant, *tool_messages], True)

    def encode(text: str) -> list[int]:
        ids: list[int] = tok.encode(text, add_special_tokens=False)
        return ids

    ids1, response_ids, ids2 = encode(prompt1), encode(response_text), encode(prompt2)
    context = ids1 + response_ids
    assert ids2[: len(context)] == context
    added = tok.decode(ids2[len(context) :], skip_special_tokens=False)
    assert "<tool_response>" in added

    assert HERMES.tool_results(added) == results

    parsed = HERMES.parse_response(tok.decode(response_ids, skip_special_tokens=False))
    assert parsed.calls == [
        ParsedToolCall(n, dumps(json.loads(a))) for n, a in zip(names, arguments, strict=True)
    ]
    assert parsed.unparsed == []
    assert parsed.content == content


# ---------------------------------------------------------------------------------------------
# qwen3_coder


def coder_block(name: str, arguments: dict[str, str], *, first: bool = True) -> str:
    """As the Qwen3-Coder chat template renders an assistant tool call."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    lead = "" if first else "\n"
    return f"{lead}<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_coder_single_call() -> None:
    text = coder_block("get_weather", {"city": "Paris", "unit": "celsius"}) + "<|im_end|>"
    assert CODER.parse_response(text) == ParsedResponse(
        content=None,
        reasoning=None,
        calls=[call("get_weather", {"city": "Paris", "unit": "celsius"})],
        unparsed=[],
    )


def test_coder_parallel_calls_with_text_around() -> None:
    text = (
        "I'll check both.\n\n"
        + coder_block("get_weather", {"city": "Paris"})
        + coder_block("read_file", {"path": "/tmp/a.txt"}, first=False)
        + "\nThen I'll summarise.<|im_end|>"
    )
    parsed = CODER.parse_response(text)
    assert parsed.calls == [
        call("get_weather", {"city": "Paris"}),
        call("read_file", {"path": "/tmp/a.txt"}),
    ]
    assert parsed.content == "I'll check both.\nThen I'll summarise."
    assert parsed.unparsed == []


def test_coder_values_are_strings_and_keep_their_inner_text() -> None:
    code = 'def f(x):\n    return x < 3 and "<b>"\n'
    text = coder_block(
        "write_file",
        {"path": "a.py", "content": code, "count": "3", "flags": '{"force": true}'},
    )
    [found] = CODER.parse_response(text).calls
    assert json.loads(found.arguments) == {
        "path": "a.py",
        "content": code,  # one wrapping newline trimmed on each side, the rest kept
        "count": "3",  # no tools schema: stays a string, as in vLLM
        "flags": '{"force": true}',
    }


def test_coder_reasoning_then_call() -> None:
    text = "<think>\nNeed the file.\n</think>\n\n" + coder_block("read_file", {"path": "x"})
    parsed = CODER.parse_response(text)
    assert parsed.reasoning == "Need the file."
    assert parsed.calls == [call("read_file", {"path": "x"})]
    assert parsed.content is None


def test_coder_missing_closers_that_vllm_accepts() -> None:
    # No </parameter> (ends at the next parameter / </function>), no </tool_call> after a
    # complete function, and a function without the <tool_call> wrapper.
    text = (
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n"
        "<tool_call>\n<function=g>\n<parameter=c>\nx\n</parameter>\n</function>\n</tool_call>\n"
        "<function=h>\n<parameter=d>\ny\n</parameter>\n</function>"
    )
    parsed = CODER.parse_response(text)
    assert parsed.calls == [
        call("f", {"a": "1", "b": "2"}),
        call("g", {"c": "x"}),
        call("h", {"d": "y"}),
    ]
    assert parsed.unparsed == []
    assert parsed.content is None


def test_coder_hermes_json_inside_tool_call() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"n": 1}}\n</tool_call>'
    assert CODER.parse_response(text).calls == [call("f", {"n": 1})]


def test_coder_call_without_parameters() -> None:
    text = "<tool_call>\n<function=list_files>\n</function>\n</tool_call>"
    assert CODER.parse_response(text).calls == [ParsedToolCall("list_files", "{}")]


def test_coder_truncated_call_is_unparsed() -> None:
    good = coder_block("f", {"a": "1"})
    cut = "<tool_call>\n<function=write_file>\n<parameter=content>\nimport os\nprint("
    parsed = CODER.parse_response(good + "\n" + cut)
    assert parsed.calls == [call("f", {"a": "1"})]
    [bad] = parsed.unparsed
    assert bad.raw == cut
    assert "</function>" in bad.error and "truncated" in bad.error


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "empty function name"),
        ("<tool_call>\n<function=f\n</function>\n</tool_call>", "not closed with '>'"),
        ("<tool_call>\nnot json\n</tool_call>", "<function=NAME>"),
    ],
)
def test_coder_malformed_calls(block: str, needle: str) -> None:
    parsed = CODER.parse_response(block)
    assert parsed.calls == []
    [bad] = parsed.unparsed
    assert bad.raw == block
    assert needle in bad.error


def test_coder_non_ascii_arguments() -> None:
    args = {"query": "Zürich café ☕", "lang": "日本語"}
    [found] = CODER.parse_response(coder_block("search", args)).calls
    assert found.arguments == dumps(args)
    assert "\\u" not in found.arguments


def test_coder_tool_results() -> None:
    # Qwen3-Coder's template: "<|im_start|>user\n<tool_response>\n...\n</tool_response>\n" per
    # result; newer Qwen3 templates put the newline before <tool_response> instead.
    added = (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nfile contents\nline 2\n</tool_response>\n"
        "<tool_response>\n{'ok': True}\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert CODER.tool_results(added) == ["file contents\nline 2", "{'ok': True}"]


# ---------------------------------------------------------------------------------------------
# gpt_oss (harmony)


def oss_call(name: str, arguments: str, *, legacy: bool = False, start: bool = True) -> str:
    if legacy:  # the header vLLM renders for history: recipient first, bare content type
        header = f"assistant to=functions.{name}<|channel|>commentary json"
    else:
        header = f"assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
    text = f"<|start|>{header}<|message|>{arguments}<|call|>"
    return text if start else text.removeprefix("<|start|>assistant")


def test_oss_single_call_after_reasoning() -> None:
    # The prompt ends with "<|start|>assistant", so the response starts at <|channel|>.
    text = (
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"San Francisco"}<|call|>'
    )
    assert OSS.parse_response(text) == ParsedResponse(
        content=None,
        reasoning="Need to use function get_weather.",
        calls=[call("get_weather", {"location": "San Francisco"})],
        unparsed=[],
    )


@pytest.mark.parametrize(
    "text",
    [
        oss_call("get_weather", '{"city": "Oslo"}', start=False),
        oss_call("get_weather", '{"city": "Oslo"}', legacy=True),
        oss_call("get_weather", '{"city": "Oslo"}', legacy=True, start=False),
        "<|channel|>commentary to=functions.get_weather<|constrain|>json"
        '<|message|>{"city":"Oslo"}<|call|>',
        '<|channel|>commentary to=functions.get_weather json<|message|>{"city":"Oslo"}<|call|>',
        '<|channel|>commentary to=functions.get_weather<|message|>{"city":"Oslo"}<|call|>',
    ],
)
def test_oss_header_variants(text: str) -> None:
    parsed = OSS.parse_response(text)
    assert parsed.calls == [call("get_weather", {"city": "Oslo"})]
    assert parsed.unparsed == [] and parsed.content is None


def test_oss_preamble_and_parallel_calls() -> None:
    text = (
        "<|channel|>analysis<|message|>Two lookups.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>**Plan**: check both cities.<|end|>"
        + oss_call("get_weather", '{"city": "Paris"}')
        + oss_call("get_weather", '{"city": "Rome"}', legacy=True)
    )
    parsed = OSS.parse_response(text)
    assert parsed.reasoning == "Two lookups."
    assert parsed.content == "**Plan**: check both cities."
    assert parsed.calls == [
        call("get_weather", {"city": "Paris"}),
        call("get_weather", {"city": "Rome"}),
    ]


def test_oss_final_answer() -> None:
    text = (
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple.<|end|>'
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
    )
    assert OSS.parse_response(text) == ParsedResponse(
        content="2 + 2 = 4.", reasoning='User asks: "What is 2 + 2?" Simple.', calls=[], unparsed=[]
    )


def test_oss_plain_text_without_markup_is_content() -> None:
    assert OSS.parse_response("just text") == ParsedResponse("just text", None, [], [])
    assert OSS.parse_response("") == ParsedResponse(None, None, [], [])


def test_oss_truncated_reasoning_and_call() -> None:
    parsed = OSS.parse_response("<|channel|>analysis<|message|>I should look")
    assert parsed.reasoning == "I should look" and parsed.calls == []
    cut = (
        "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json"
        '<|message|>{"a": [1,'
    )
    parsed = OSS.parse_response("<|channel|>analysis<|message|>ok<|end|>" + cut)
    assert parsed.calls == []
    [bad] = parsed.unparsed
    assert bad.raw == cut
    assert "<|call|>" in bad.error and "truncated" in bad.error


def test_oss_truncated_in_header() -> None:
    cut = "<|start|>assistant<|channel|>commentary to=functions.f"
    [bad] = OSS.parse_response("<|channel|>analysis<|message|>x<|end|>" + cut).unparsed
    assert bad.raw == cut and "<|message|>" in bad.error


def test_oss_call_without_the_stop_token_is_complete() -> None:
    # <|call|> is a stop token; a server may leave it out of the output.
    text = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}'
    assert OSS.parse_response(text).calls == [call("f", {"a": 1})]


def test_oss_invalid_json_is_unparsed() -> None:
    bad_call = oss_call("f", '{"a": 1,,}')
    parsed = OSS.parse_response(bad_call + oss_call("g", "{}"))
    assert parsed.calls == [call("g", {})]
    [bad] = parsed.unparsed
    assert bad.raw == bad_call
    assert bad.error.startswith("invalid JSON arguments: ")


def test_oss_builtin_tool_with_code_content_type() -> None:
    text = (
        "<|channel|>analysis<|message|>Compute it.<|end|>"
        "<|start|>assistant<|channel|>analysis to=python code<|message|>print(2 ** 10)<|call|>"
    )
    parsed = OSS.parse_response(text)
    assert parsed.calls == [ParsedToolCall("python", "print(2 ** 10)")]
    assert parsed.reasoning == "Compute it."


def test_oss_non_ascii_arguments() -> None:
    parsed = OSS.parse_response(oss_call("search", '{"q": "caf\\u00e9 in Zürich ☕"}'))
    assert parsed.calls == [ParsedToolCall("search", '{"q": "café in Zürich ☕"}')]


def test_oss_tool_results() -> None:
    added = (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '{"sunny": true, "temperature": 20}<|end|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        "Zürich: 12 °C\nwindy<|end|>"
        "<|start|>assistant"
    )
    assert OSS.tool_results(added) == ['{"sunny": true, "temperature": 20}', "Zürich: 12 °C\nwindy"]
    # The response's stop token may come first; user / assistant messages are no results.
    added = (
        "<|call|><|start|>python to=assistant<|channel|>analysis<|message|>1024<|end|>"
        "<|start|>user<|message|>thanks<|end|><|start|>assistant"
    )
    assert OSS.tool_results(added) == ["1024"]


# ---------------------------------------------------------------------------------------------
# Property: whatever name and arguments a call has, rendered in the format it parses back.

NO_MARKUP = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
             "</parameter>", "<think>", "</think>", "<|")  # fmt: skip

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
arguments_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=5)


def clean(text: str) -> bool:
    return not any(marker in text for marker in NO_MARKUP)


# Tool names as the templates write them: no quotes or escapes (the Hermes template does not
# JSON-escape the name), no '>' or whitespace (XML tag / harmony recipient).
names = st.text(
    alphabet=st.characters(
        blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp"), blacklist_characters='"\\<>'
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(name=names, arguments=arguments_objects, text=st.text(max_size=20))
def test_property_hermes_round_trip(name: str, arguments: dict[str, Any], text: str) -> None:
    rendered = hermes_block(name, arguments)
    assume(clean(rendered[len("<tool_call>") : -len("</tool_call>")]) and clean(text))
    parsed = HERMES.parse_response(text + "\n" + rendered + "<|im_end|>")
    assert parsed.calls == [call(name, arguments)]
    assert parsed.unparsed == []
    assert parsed.content == (text.strip() or None)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=names, arguments=arguments_objects)
def test_property_hermes_round_trip_through_the_real_template(
    qwen_tokenizer: Any, name: str, arguments: dict[str, Any]
) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
    ]
    prompt = qwen_tokenizer.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True
    )
    full = qwen_tokenizer.apply_chat_template(messages, tokenize=False)
    response = full[len(prompt) :].removesuffix("\n")
    assume(clean(response.removeprefix("<tool_call>").removesuffix("</tool_call><|im_end|>")))
    assert HERMES.parse_response(response).calls == [call(name, arguments)]


coder_names = names.filter(lambda n: n == n.strip())
coder_keys = st.text(
    alphabet=st.characters(
        blacklist_categories=("Cs", "Cc", "Zl", "Zp"), blacklist_characters="<>"
    ),
    min_size=1,
    max_size=12,
).filter(lambda k: k == k.strip())


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(
        st.tuples(coder_names, st.dictionaries(coder_keys, st.text(max_size=40), max_size=5)),
        min_size=1,
        max_size=3,
    )
)
def test_property_qwen3_coder_round_trip(calls: list[tuple[str, dict[str, str]]]) -> None:
    assume(all(clean(v) for _, args in calls for v in args.values()))
    rendered = "".join(coder_block(n, a, first=k == 0) for k, (n, a) in enumerate(calls))
    parsed = CODER.parse_response(rendered + "<|im_end|>")
    assert parsed.calls == [call(n, a) for n, a in calls]
    assert parsed.unparsed == []


@settings(max_examples=150, deadline=None)
@given(
    name=names,
    arguments=arguments_objects,
    legacy=st.booleans(),
    compact=st.booleans(),
    reasoning=st.text(max_size=30),
)
def test_property_gpt_oss_round_trip(
    name: str, arguments: dict[str, Any], legacy: bool, compact: bool, reasoning: str
) -> None:
    body = json.dumps(arguments, separators=(",", ":") if compact else None, ensure_ascii=compact)
    assume(clean(body) and clean(reasoning))
    text = f"<|channel|>analysis<|message|>{reasoning}<|end|>" + oss_call(name, body, legacy=legacy)
    parsed = OSS.parse_response(text)
    assert parsed.calls == [call(name, arguments)]
    assert parsed.reasoning == (reasoning.strip() or None)
    assert parsed.unparsed == []


@settings(max_examples=100, deadline=None)
@given(results=st.lists(st.text(max_size=40), min_size=1, max_size=4))
def test_property_tool_results_round_trip(results: list[str]) -> None:
    assume(all(clean(r) and "tool_response>" not in r for r in results))
    chatml = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    added = f"<|im_end|>\n<|im_start|>user{chatml}<|im_end|>\n<|im_start|>assistant\n"
    assert HERMES.tool_results(added) == results
    assert CODER.tool_results(added) == results
    harmony = "".join(
        f"<|start|>functions.f{k} to=assistant<|channel|>commentary<|message|>{r}<|end|>"
        for k, r in enumerate(results)
    )
    assert OSS.tool_results(harmony + "<|start|>assistant") == results


# ---------------------------------------------------------------------------------------------
# turns: the messages a piece of prompt text writes


def test_chatml_turns_of_a_first_prompt_and_of_what_a_later_one_adds() -> None:
    opening = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nRain in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert HERMES.turns(opening) == [Turn("system", "Be brief."), Turn("user", "Rain in Oslo?")]
    added = (
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n"
        "{}\n</tool_response><|im_end|>\n<|im_start|>user\nAnd in French?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    expected = [Turn("tool", "rain"), Turn("tool", "{}"), Turn("user", "And in French?")]
    # After an answer that wrote its end-of-turn token, one that did not, and verl's way (the
    # ids of the next turn right after `<|im_end|>`).
    for closing in ("\n", "<|im_end|>\n", ""):
        assert HERMES.turns(closing + added, after_answer=True) == expected
        assert CODER.turns(closing + added, after_answer=True) == expected
    # A user turn with words besides a tool response is the user's.
    said = "<|im_start|>user\nSee: <tool_response>\nx\n</tool_response><|im_end|>\n"
    assert HERMES.turns(said) == [Turn("user", "See: <tool_response>\nx\n</tool_response>")]
    assert HERMES.turns("\n<|im_start|>assistant\n", after_answer=True) == []


def test_text_outside_chatml_turns_is_not_read_as_turns() -> None:
    assert HERMES.turns("User: hi\nAssistant:") is None
    assert HERMES.turns("\nUser: And then?\nAssistant:", after_answer=True) is None
    # The close of an answer's turn is only skipped after an answer.
    assert HERMES.turns("\n<|im_start|>user\nhi<|im_end|>\n") is None
    assert HERMES.turns("<|im_start|>user\nhi<|im_end|>\nand more words") is None
    assert HERMES.turns(" and more<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n", True) is None


def test_harmony_turns() -> None:
    opening = (
        "<|start|>system<|message|>You are ChatGPT.<|end|><|start|>developer<|message|># Tools"
        "<|end|><|start|>user<|message|>Weather in Oslo?<|end|><|start|>assistant"
    )
    assert OSS.turns(opening) == [
        Turn("system", "You are ChatGPT."), Turn("developer", "# Tools"),
        Turn("user", "Weather in Oslo?"),
    ]  # fmt: skip
    added = (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '{"sky": "rain"}<|end|><|start|>user<|message|>In French?<|end|><|start|>assistant'
    )
    expected = [Turn("tool", '{"sky": "rain"}', "get_weather"), Turn("user", "In French?")]
    assert OSS.turns(added, after_answer=True) == expected
    assert OSS.turns("<|call|>" + added, after_answer=True) == expected
    earlier = (
        "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Oslo"}<|call|>'
    )
    [turn] = OSS.turns(earlier + "<|start|>assistant") or []
    assert turn.role == "assistant"
    parsed = OSS.parse_response(turn.content)
    assert parsed.reasoning == "Look it up." and parsed.calls == [
        call("get_weather", {"city": "Oslo"})
    ]
    assert OSS.turns("User: hi") is None
    assert OSS.turns("<|start|>user<|message|>cut off") is None
