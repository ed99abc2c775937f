"""A chat turn that sends the model's reply back stores only what it added, and readers get
the exact request back: `expand_prompts(share_prefixes(x)) == x` for every kind of prompt."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import httpx
import orjson
from fakes import FakeVLLM
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI
from support.proxies import running_proxy, trajectories

from trace_proxy.trajectories.prompts import expand_prompts, reply_reference, share_prefixes
from trace_proxy.trajectories.record import (
    GenerateCall,
    Output,
    Prompt,
    RolloutKey,
    Trajectory,
    dumps,
    loads,
)

Json = dict[str, Any]
Continued = tuple[str, Output | None]  # how the next request went on, from which output
TILDE = "~"  # never drawn: appending it makes a value no output has
words = st.text(alphabet='ab \n{}"é', max_size=6)
some_words = st.text(alphabet='ab \n{}"é', min_size=1, max_size=6)


def json_bytes(value: Any) -> bytes:
    """A JSON value as bytes that differ whenever the values differ (types, members) and when
    objects list their members in another order."""
    return orjson.dumps(value)


@st.composite
def tool_call(draw: st.DrawFn) -> Json:
    return {
        "id": "call-" + draw(st.sampled_from("xyz")),
        "type": "function",
        "function": {"name": draw(st.sampled_from(["f", "g"])), "arguments": draw(words)},
    }


@st.composite
def output(draw: st.DrawFn, index: int) -> Output:
    return Output(
        index=index,
        text=draw(st.none() | some_words),
        tool_calls=draw(st.none() | st.lists(tool_call(), min_size=1, max_size=2)),
        reasoning=draw(st.none() | some_words),
        finish_reason="stop",
    )


def echo(out: Output, style: str) -> Json:
    """The assistant message a client sends back for `out`, the way clients build it."""
    if style == "plain":  # a hand-written client: content, and tool calls when there are some
        message: Json = {"role": "assistant", "content": out.text}
        if out.tool_calls:
            message["tool_calls"] = copy.deepcopy(out.tool_calls)
        return message
    if style == "sdk":  # openai's `messages.append(choice.message)`: its member order, nulls
        calls = [
            {"id": c["id"], "function": {"arguments": c["function"]["arguments"],
             "name": c["function"]["name"]}, "type": c["type"]}
            for c in out.tool_calls or []
        ]  # fmt: skip
        return {"content": out.text, "refusal": None, "role": "assistant", "annotations": None,
                "audio": None, "function_call": None, "tool_calls": calls,
                "reasoning_content": out.reasoning}  # fmt: skip
    # the demo's agent: content, tool calls or null, and the reasoning sent back
    return {"role": "assistant", "content": out.text, "tool_calls": out.tool_calls or None,
            "reasoning": out.reasoning}  # fmt: skip


def tweaked(message: Json, how: str) -> Json:
    """The echo with one small difference an output does not have."""
    changed = copy.deepcopy(message)
    if how == "tool_arguments" and changed.get("tool_calls"):
        changed["tool_calls"][0]["function"]["arguments"] += TILDE
    elif how == "tool_without_type" and changed.get("tool_calls"):
        del changed["tool_calls"][0]["type"]
    elif how == "content_dropped" and changed.get("content") is not None:
        changed["content"] = None
    else:
        changed["content"] = (changed.get("content") or "") + TILDE
    return changed


@st.composite
def chat_trajectory(draw: st.DrawFn) -> tuple[list[GenerateCall], list[Continued]]:
    """Chat turns, each continuing the last in one way: the reply echoed (by one of the
    client styles), echoed with a small change, not echoed, or history dropped; with n > 1
    outputs, streamed calls, and completions calls in between."""
    calls: list[GenerateCall] = []
    how: list[Continued] = []
    messages: list[Json] = [{"role": "user", "content": draw(words)}]
    tools = draw(st.none() | st.just([{"type": "function", "function": {"name": "f"}}]))
    for position in range(draw(st.integers(1, 6))):
        if draw(st.integers(0, 5)) == 0:  # a completions call of the same rollout
            text = draw(words)
            ids = draw(st.none() | st.lists(st.integers(0, 9), max_size=8))
            outputs = [Output(index=0, text=draw(words), token_ids=draw(st.lists(
                st.integers(0, 9), max_size=4)))]  # fmt: skip
            calls.append(make_call(position, Prompt(token_ids=ids, text=text), outputs, False))
            how.append(("completions", None))
            continue
        outputs = [draw(output(i)) for i in range(draw(st.integers(1, 3)))]
        sent = Prompt(messages=copy.deepcopy(messages), tools=copy.deepcopy(tools))
        calls.append(make_call(position, sent, outputs, draw(st.booleans())))
        chosen = outputs[draw(st.integers(0, len(outputs) - 1))]
        kind = draw(st.sampled_from(["plain", "sdk", "agent", "tweaked", "none", "dropped"]))
        if kind in ("plain", "sdk", "agent"):
            messages = [*messages, echo(chosen, kind)]
        elif kind == "tweaked":
            change = draw(st.sampled_from(
                ["content", "tool_arguments", "tool_without_type", "content_dropped"]))  # fmt: skip
            messages = [*messages, tweaked(echo(chosen, draw(st.sampled_from(["plain", "sdk"]))),
                                           change)]  # fmt: skip
        elif kind == "dropped":
            messages = messages[: draw(st.integers(0, len(messages) - 1))]
        how.append((kind, chosen))
        for _ in range(draw(st.integers(0 if kind != "dropped" else 1, 2))):
            messages = [*messages, {"role": draw(st.sampled_from(["user", "tool"])),
                                    "content": draw(words)}]  # fmt: skip
    return calls, how


def make_call(position: int, prompt: Prompt, outputs: list[Output], stream: bool) -> GenerateCall:
    chat = prompt.messages is not None
    return GenerateCall(
        index=position, dialect="openai.chat" if chat else "openai.completions",
        route="/v1/chat/completions" if chat else "/v1/completions", upstream="u",
        start=float(position), end=position + 0.5, stream=stream, prompt=prompt, outputs=outputs,
    )  # fmt: skip


def stored(calls: list[GenerateCall]) -> Json:
    """The trajectory as a reader gets it from the store (one JSON line)."""
    key = RolloutKey(project="p", experiment="e", step=1, sample_index=0, rollout_n=0,
                     validate=False, trajectory_id=None)  # fmt: skip
    record = Trajectory(id="t", key=key, start=0, end=9, status="ok", close_reason="done",
                        calls=calls)  # fmt: skip
    data: Json = orjson.loads(dumps(record))
    assert loads(dumps(record)) == record  # the spool's way back gives the same record
    return data


def full_prompt(prompt: Prompt) -> Json:
    return {"messages": prompt.messages, "text": prompt.text, "token_ids": prompt.token_ids,
            "tools": prompt.tools or None}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(chat_trajectory())
def test_what_is_shared_reads_back_as_sent(
    case: tuple[list[GenerateCall], list[Continued]],
) -> None:
    calls, how = case
    sent = [full_prompt(copy.deepcopy(c.prompt)) for c in calls]
    share_prefixes(calls)
    record = stored(calls)
    for position, (prompt, expected) in enumerate(zip(expand_prompts(record), sent, strict=True)):
        prompt["tools"] = prompt.get("tools") or None  # `[]`: this call sent none
        got = {kind: prompt.get(kind) for kind in expected}
        assert json_bytes(got) == json_bytes(expected), position
    for position in range(1, len(calls)):
        before, chosen = how[position - 1]
        if calls[position].dialect != "openai.chat":
            continue
        stored_prompt = record["calls"][position]["prompt"]
        count = len(sent[position - 1]["messages"] or [])
        tweaked_into_another = (
            stored_prompt["prefix_reply"] is not None
            and chosen is not None
            and stored_prompt["prefix_reply"]["output"] != chosen.index
        )
        if before == "tweaked" and not tweaked_into_another:
            # stored as sent, from the changed reply on (unless the change made it another
            # choice's reply exactly: then that choice is named, as for a plain reply)
            assert stored_prompt["prefix_reply"] is None
            assert stored_prompt["prefix_len"] == {"messages": count}
            assert stored_prompt["messages"] == sent[position]["messages"][count:]
        if before in ("plain", "sdk", "agent") and chosen and (chosen.text or chosen.tool_calls):
            # the reply is not stored again: what the call added follows it
            reply = stored_prompt["prefix_reply"]
            assert reply is not None and reply["from_output"]
            assert stored_prompt["prefix_len"] == {"messages": count + 1}
            assert stored_prompt["messages"] == sent[position]["messages"][count + 1 :]


def test_an_echo_of_the_second_choice_names_it() -> None:
    outputs = [Output(index=0, text="left"), Output(index=1, text="right")]
    reference = reply_reference({"role": "assistant", "content": "right"}, outputs)
    assert reference == {"output": 1, "message": {"role": "assistant", "content": None},
                         "from_output": ["content"]}  # fmt: skip


def test_values_of_other_json_types_are_not_the_reply() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    out = Output(index=0, text="ok", tool_calls=[call])
    renumbered = copy.deepcopy(call)
    renumbered["index"] = 0
    for tool_calls in ([renumbered], [{**call, "id": 1}], [call, call]):
        message = {"role": "assistant", "content": "ok", "tool_calls": tool_calls}
        assert reply_reference(message, [out]) is None
    assert reply_reference({"role": "user", "content": "ok", "tool_calls": [call]}, [out]) is None
    assert reply_reference({"role": "assistant", "content": "ok"}, [out]) is None  # calls left out
    assert reply_reference({"role": "assistant", "tool_calls": [call]}, [out]) is None


def test_records_without_prefix_reply_read_as_before() -> None:
    """A record of the previous schema: the context of a chat call is its messages alone."""
    first = [{"role": "user", "content": "hi"}]
    record = {"schema": "trace-proxy.trajectory/2", "calls": [
        {"prompt": {"messages": first, "tools": None, "prefix_call": None, "prefix_len": None},
         "outputs": [{"index": 0, "text": "yo"}]},
        {"prompt": {"messages": [{"role": "assistant", "content": "yo"}], "tools": None,
                    "prefix_call": 0, "prefix_len": {"messages": 1}},
         "outputs": []},
    ]}  # fmt: skip
    assert [p["messages"] for p in expand_prompts(record)] == [
        first,
        [*first, {"role": "assistant", "content": "yo"}],
    ]


def test_a_member_of_another_json_type_is_not_the_outputs() -> None:
    """`true` and `1` are equal in Python and different JSON: such a message is stored."""
    call = {"id": "c", "type": "function", "index": 1,
            "function": {"name": "f", "arguments": "{}"}}  # fmt: skip
    out = Output(index=0, text=None, tool_calls=[call])
    for index in (True, 1.0):
        message = {"role": "assistant", "tool_calls": [{**call, "index": index}]}
        assert reply_reference(message, [out]) is None
    assert reply_reference({"role": "assistant", "tool_calls": [call]}, [out]) is not None


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}  # fmt: skip


async def test_openai_agent_with_tools_stores_each_reply_once(
    fake_vllm: tuple[FakeVLLM, str], tmp_path: Path
) -> None:
    """The OpenAI SDK's agent loop: `choice.message` sent back as the SDK writes it, a streamed
    turn's reply rebuilt by the client, the second of two choices, and a reply the client
    edited (stored as sent). The store holds each reply once and gives back every request."""
    _, upstream = fake_vllm
    sent: dict[str, list[Json]] = {"agent": [], "edited": []}

    async def keep(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent[request.headers["x-rollout-trajectory-id"]].append(orjson.loads(request.content))

    async with running_proxy([upstream], tmp_path) as (_, proxy):
        http = httpx.AsyncClient(event_hooks={"request": [keep]})
        client = AsyncOpenAI(base_url=proxy + "/v1", api_key="sk-test", http_client=http)
        for trajectory in sent:
            await agent_loop(client, trajectory, edit=trajectory == "edited")
        await client.close()
    records = {t["key"]["trajectory_id"]: t for t in trajectories(tmp_path)}
    for name, bodies in sent.items():
        record = records[name]
        assert len(record["calls"]) == len(bodies) >= 3
        expanded = expand_prompts(record)
        for body, prompt in zip(bodies, expanded, strict=True):
            assert json_bytes(prompt["messages"]) == json_bytes(body["messages"])
            assert prompt["tools"] == body["tools"]
    calls, bodies = records["agent"]["calls"], sent["agent"]
    for position in range(1, len(calls)):
        before = len(bodies[position - 1]["messages"])
        prompt = calls[position]["prompt"]
        assert prompt["prefix_len"]["messages"] == before + 1
        assert prompt["messages"] == bodies[position]["messages"][before + 1 :]
        assert "tool_calls" in prompt["prefix_reply"]["from_output"]
    sdk_echo = calls[1]["prompt"]["prefix_reply"]["message"]
    assert "refusal" in sdk_echo  # the SDK's own members, and its order of a tool call's
    assert sdk_echo["tool_calls"] == [{"id": None, "function": {"arguments": None, "name": None},
                                       "type": None}]  # fmt: skip
    assert calls[2]["prompt"]["prefix_reply"]["message"]["tool_calls"] is None  # output order
    assert calls[3]["prompt"]["prefix_reply"]["output"] == 1  # the second choice
    stored = sum(len(orjson.dumps([c["prompt"]["messages"], c["prompt"]["prefix_reply"]]))
                 for c in calls[1:])  # fmt: skip
    whole_replies = sum(len(orjson.dumps(b["messages"][len(a["messages"]):]))
                        for a, b in itertools.pairwise(bodies))  # fmt: skip
    assert stored < whole_replies
    edited = records["edited"]["calls"]
    assert edited[1]["prompt"]["prefix_reply"] is None
    assert edited[1]["prompt"]["messages"][0]["content"].endswith(" (edited)")


async def agent_loop(client: AsyncOpenAI, trajectory: str, edit: bool) -> None:
    """Tool rounds until the model answers: turn 1 plain, turn 2 streamed, turn 3 with n=2."""
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo, Bergen and Tromso today?"}]
    headers = {"X-Rollout-Trajectory-Id": trajectory}
    for turn in range(6):
        kwargs: Json = {"model": "tiny-qwen", "messages": messages, "tools": [WEATHER_TOOL],
                        "extra_headers": headers,
                        "extra_body": {"return_token_ids": True}}  # fmt: skip
        if turn == 1:
            content, calls = "", {}
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for fragment in choice.delta.tool_calls or []:
                        entry = calls.setdefault(fragment.index, {
                            "id": fragment.id, "type": "function",
                            "function": {"name": "", "arguments": ""}})  # fmt: skip
                        if fragment.function is not None:
                            entry["function"]["name"] += fragment.function.name or ""
                            entry["function"]["arguments"] += fragment.function.arguments or ""
            reply: Json = {"role": "assistant", "content": content or None,
                           "tool_calls": [calls[k] for k in sorted(calls)]}  # fmt: skip
        else:
            response = await client.chat.completions.create(n=2 if turn == 2 else 1, **kwargs)
            message = response.choices[-1].message  # the SDK's object, sent back as it is
            reply = message.model_dump() if edit else message  # type: ignore[assignment]
            if edit:
                reply["content"] = (reply["content"] or "") + " (edited)"
        messages.append(reply)
        tool_calls = reply["tool_calls"] if isinstance(reply, dict) else reply.tool_calls
        if not tool_calls:
            return
        for call in tool_calls:
            call_id = call["id"] if isinstance(call, dict) else call.id
            messages.append({"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 18}'})
