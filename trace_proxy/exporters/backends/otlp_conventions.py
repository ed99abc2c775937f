"""A trajectory's spans as the OpenTelemetry GenAI semantic conventions name them: a call's input
and output messages in the conventions' parts format, and the attributes of the root, generate
and tool spans. Pure: the exporter (`otlp.py`) starts and ends the spans and sends them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import orjson
from opentelemetry import trace

from trace_proxy.exporters.backends.spans import (
    ROOT_NAME,
    Generation,
    Tool,
    TrajectorySpans,
    error_text,
    ns,
)
from trace_proxy.trajectories.record import CallError

# key field -> root attribute; the MLflow trace tag is `mlflow.traceTag.<key field>`
KEY_ATTRIBUTES = {
    "project": "rollout.project",
    "experiment": "rollout.experiment",
    "step": "rollout.step",
    "sample_index": "rollout.sample_index",
    "rollout_n": "rollout.n",
    "validate": "rollout.validate",
    "trajectory_id": "rollout.trajectory_id",
    "sample_hash": "rollout.sample_hash",
}
SAMPLING_FLOATS = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
}
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens")
# Asynchronous RL, in the `rl.*` namespace proposed for the GenAI conventions
# (open-telemetry/semantic-conventions-genai#88): provisional names, none settled there yet.
# No name is also a namespace (`rl.policy.version` is one attribute, so its bounds are
# `rl.policy.version_min`, not `rl.policy.version.min`), as the conventions' naming asks.
RL_VERSION = "rl.policy.version"  # the version that generated a call (its last attempt)
RL_LAG = "rl.policy.lag"  # versions behind the newest the proxy had seen at close
RL_ROOT = {  # `Root.policy_fields` name -> root attribute
    "sample_id": "rl.sample.id",
    "weight_version_min": "rl.policy.version_min",
    "weight_version_max": "rl.policy.version_max",
    "weight_version_latest": "rl.policy.version_latest",
    "version_spread": "rl.policy.version_spread",
    "version_lag": RL_LAG,
    "partial_rollout": "rl.rollout.partial",
}
Attributes = dict[str, Any]


class CallView:
    """One generate call, with its full input and output rendered as convention messages."""

    __slots__ = ("call", "conversation", "input_messages", "lag", "operation", "output_messages",
                 "prompt_note", "provider", "tool_definitions")  # fmt: skip

    def __init__(
        self, call: Generation, providers: dict[str, str], conversation: str, lag: int | None
    ) -> None:
        self.call = call
        self.lag = lag  # `Root.lag_of`
        self.conversation = conversation
        self.operation = call.declared.operations.gen_ai
        self.provider = call.declared.provider or providers.get(call.upstream or "")
        self.input_messages: str | None = None
        self.output_messages: str | None = None
        self.tool_definitions: str | None = None
        self.prompt_note: Attributes = {}

    def attributes(self) -> Attributes:
        call = self.call
        a: Attributes = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.conversation.id": self.conversation,
            "gen_ai.request.stream": call.stream,
        }
        put(a, "gen_ai.provider.name", self.provider)
        put(a, "gen_ai.request.model", call.model)
        put(a, "gen_ai.response.model", call.model)
        _sampling(a, call.sampling)
        put(a, "gen_ai.response.id", call.request_id)
        finish = [
            o["finish_reason"] for o in call.outputs if isinstance(o.get("finish_reason"), str)
        ]
        if finish:
            a["gen_ai.response.finish_reasons"] = finish
        _usage(a, call.usage)
        put(a, "gen_ai.input.messages", self.input_messages)
        put(a, "gen_ai.output.messages", self.output_messages)
        put(a, "gen_ai.tool.definitions", self.tool_definitions)
        a.update(self.prompt_note)
        put(a, "http.response.status_code", int_or_none(call.http_status))
        _server(a, call.upstream)
        a["trace_proxy.call.index"] = call.index
        a["trace_proxy.dialect"] = call.dialect
        a["trace_proxy.route"] = call.route
        a["trace_proxy.upstream"] = call.upstream
        put(a, "rollout.weight_version", call.weight_version)
        put(a, RL_VERSION, call.weight_version)
        put(a, RL_LAG, self.lag)
        put(a, "trace_proxy.unparsed", call.unparsed)
        if call.error is not None:
            a["error.type"] = call.error.get("type")
        return a


def providers_of(calls: tuple[Generation, ...]) -> dict[str, str]:
    """Which server each upstream is, as far as a native dialect to it tells."""
    found: dict[str, str] = {}
    for call in calls:
        provider = call.declared.provider
        if provider is not None and call.upstream is not None:
            found.setdefault(call.upstream, provider)
    return found


def fill_messages(view: TrajectorySpans, calls: list[CallView]) -> None:
    """Full inputs and outputs of every call, as `gen_ai.*.messages` JSON strings."""
    if not calls:
        return
    decoded = _decoded_prompts(view)
    for call_view, text in zip(calls, decoded, strict=True):
        call = call_view.call
        prompt = call.prompt
        if call_view.operation == "chat" and prompt.get("messages") is not None:
            call_view.input_messages = json_text([_chat_message(m) for m in prompt["messages"]])
        else:
            full = text if text is not None else prompt.get("text")
            if full is None and call.prompt_piece is not None:
                # Part of the prompt is shared with an earlier call whose decoded text cannot
                # be cut at a token boundary here: send the decoded rest, and say so.
                full = call.prompt_piece
                omitted = (call.stored_prompt.get("prefix_len") or {}).get("token_ids", 0)
                call_view.prompt_note = {
                    "trace_proxy.prompt.prefix_call": call.stored_prompt.get("prefix_call"),
                    "trace_proxy.prompt.omitted_prefix_tokens": omitted,
                }
            if full is not None:
                call_view.input_messages = json_text([_text_message("user", full)])
        if prompt.get("tools"):
            call_view.tool_definitions = json_text(prompt["tools"])
        outputs = [_output_message(o, call) for o in call.outputs]
        if any(m["parts"] for m in outputs):
            call_view.output_messages = json_text(outputs)


def _decoded_prompts(view: TrajectorySpans) -> list[str | None]:
    """Each call's full prompt as token2text decoded it, where the stored pieces spell it out:
    `prompt_text` is the decoded stored suffix; a call that extends the whole context (prompt +
    first response) of the call it shares with prepends that call's full text.

    Stricter than the view's `prompt_text`, which also joins a prompt that kept the earlier
    prompt but not its response; and the last call's text comes from a stored transcript."""
    calls = view.calls
    full: list[str | None] = []
    context: list[int | None] = []  # token count of prompt + first output, per call
    for position, call in enumerate(calls):
        prompt = call.stored_prompt
        token_ids = prompt.get("token_ids")
        ids = len(token_ids) if token_ids is not None else None
        shared = (prompt.get("prefix_len") or {}).get("token_ids")
        ref = prompt.get("prefix_call")
        first = call.outputs[0] if call.outputs else None
        text: str | None = None
        prompt_len: int | None = ids
        if ref is None or shared is None:
            text = call.prompt_piece
        elif 0 <= ref < position:
            prompt_len = None if ids is None else shared + ids
            base = calls[ref].outputs[0] if calls[ref].outputs else None
            response = (
                "" if base is None or not base.get("token_ids") else base.get("response_text")
            )
            if (
                call.prompt_piece is not None
                and full[ref] is not None
                and context[ref] == shared
                and response is not None
            ):
                text = f"{full[ref]}{response}{call.prompt_piece}"
        full.append(text)
        outputs = len(first["token_ids"]) if first is not None and first.get("token_ids") else 0
        context.append(None if prompt_len is None else prompt_len + outputs)
    last = calls[-1] if calls else None
    transcript = view.root.transcript if view.root.transcript_stored else None
    if (
        last is not None
        and transcript is not None
        and last.stored_prompt.get("token_ids") is not None
        and last.prompt_piece is not None
    ):
        # A stored transcript is the last call's whole context decoded in one piece: stored
        # because the pieces do not spell it out (a re-rendered turn, a character split
        # across pieces), so it is the better text of the last call's prompt.
        first = last.outputs[0] if last.outputs else None
        response = (
            first.get("response_text") if first is not None and first.get("token_ids") else ""
        )
        if response is not None and transcript.endswith(response):
            full[-1] = transcript[: len(transcript) - len(response)]
    return full


def _chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message in the conventions' {role, parts} form."""
    role = message.get("role")
    parts: list[dict[str, Any]] = []
    content = message.get("content")
    if role == "tool":
        parts.append(
            {"type": "tool_call_response", "id": message.get("tool_call_id"), "response": content}
        )
    else:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            parts.append({"type": "reasoning", "content": reasoning})
        parts += _content_parts(content)
        for tool_call in message.get("tool_calls") or []:
            if isinstance(tool_call, Mapping):
                parts.append(_tool_call_part(tool_call))
    result: dict[str, Any] = {"role": role, "parts": parts}
    if message.get("name") is not None:
        result["name"] = message["name"]
    return result


def _content_parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for item in content:
            if isinstance(item, str):
                parts.append({"type": "text", "content": item})
            elif isinstance(item, Mapping) and item.get("type") == "text":
                parts.append({"type": "text", "content": item.get("text")})
            elif isinstance(item, Mapping):
                parts.append(dict(item))  # image_url, input_audio...: a generic part as sent
        return parts
    return [{"type": "text", "content": str(content)}]


def _tool_call_part(tool_call: Mapping[str, Any]) -> dict[str, Any]:
    function = tool_call.get("function")
    function = function if isinstance(function, Mapping) else {}
    return {
        "type": "tool_call",
        "id": tool_call.get("id"),
        "name": function.get("name"),
        "arguments": _json_or_text(function.get("arguments")),
    }


def _text_message(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": text}]}


def _output_message(output: Mapping[str, Any], call: Generation) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if output.get("reasoning"):
        parts.append({"type": "reasoning", "content": output["reasoning"]})
    text = output.get("response_text")
    if text is None:
        text = output.get("text")
    if text:
        parts.append({"type": "text", "content": text})
    for tool_call in output.get("tool_calls") or []:
        if isinstance(tool_call, Mapping):
            parts.append(_tool_call_part(tool_call))
    finish = output.get("finish_reason")
    finish = finish if isinstance(finish, str) else None
    return {
        "role": "assistant",
        "parts": parts,
        "finish_reason": finish or ("error" if call.error is not None else ""),
    }


def root_attributes(view: TrajectorySpans, conversation: str, calls: list[CallView]) -> Attributes:
    t = view.root
    a: Attributes = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": ROOT_NAME,
        "gen_ai.conversation.id": conversation,
    }
    names = {v.provider for v in calls}
    if len(names) == 1:
        put(a, "gen_ai.provider.name", names.pop())
    models = {v.call.model for v in calls}
    if len(models) == 1:
        put(a, "gen_ai.request.model", models.pop())
    if calls:
        put(a, "gen_ai.input.messages", calls[0].input_messages)
        put(a, "gen_ai.output.messages", calls[-1].output_messages)
    key = t.key
    tags: dict[str, Any] = {}
    for field, attribute in KEY_ATTRIBUTES.items():
        value = key.get(field)
        if value is not None:
            a[attribute] = value
            tags[field] = value
    a["rollout.record_id"] = t.record_id
    a["rollout.part"] = t.part
    a["rollout.status"] = t.status
    a["rollout.close_reason"] = t.close_reason
    put(a, "rollout.reward", _float(t.reward))
    put(a, "rollout.score", _float(t.score))
    if t.labels:
        a["rollout.labels"] = json_text(t.labels)
    if key.get("sources"):
        a["rollout.key_sources"] = json_text(key["sources"])
    if t.weight_versions:
        a["rollout.weight_versions"] = [str(v) for v in t.weight_versions]
    for field, attribute in RL_ROOT.items():
        put(a, attribute, t.policy_fields()[field])
    if t.upstreams:
        a["trace_proxy.upstreams"] = [str(u) for u in t.upstreams]
    if t.annotations:
        a["trace_proxy.annotations"] = json_text(t.annotations)
    for name, count in (t.summary or {}).items():
        if isinstance(count, int) and not isinstance(count, bool):
            a[f"trace_proxy.summary.{name}"] = count
    tags.update(record_id=t.record_id, part=t.part, status=t.status, close_reason=t.close_reason)
    if t.reward is not None:
        tags["reward"] = t.reward
    if t.score is not None:
        tags["score"] = t.score
    for field, value in tags.items():
        a[f"mlflow.traceTag.{field}"] = _tag(value)
    return a


def span_attributes_of_tool(tool: Tool, conversation: str) -> Attributes:
    a: Attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.conversation.id": conversation,
        "trace_proxy.tool.index": tool.index,
        "trace_proxy.tool.observed": tool.observed,
    }
    put(a, "gen_ai.tool.name", tool.name)
    put(a, "gen_ai.tool.call.id", tool.call_id)
    put(a, "gen_ai.tool.call.arguments", tool.arguments)
    put(a, "gen_ai.tool.call.result", tool.result)
    put(a, "trace_proxy.tool.requested_by", int_or_none(tool.requested_by))
    if tool.end is None:
        a["trace_proxy.tool.unanswered"] = True
    put(a, "trace_proxy.tool.raw", tool.raw)
    put(a, "trace_proxy.route", tool.route)
    put(a, "trace_proxy.upstream", tool.upstream)
    put(a, "http.response.status_code", int_or_none(tool.http_status))
    if tool.upstream:
        _server(a, tool.upstream)
    if tool.error is not None:
        a["error.type"] = tool.error.get("type")
    return a


def _sampling(a: Attributes, sampling: Mapping[str, Any]) -> None:
    for field, attribute in SAMPLING_FLOATS.items():
        put(a, attribute, _float(sampling.get(field)))
    for field in MAX_TOKENS_FIELDS:
        value = int_or_none(sampling.get(field))
        if value is not None:
            a["gen_ai.request.max_tokens"] = value
            break
    put(a, "gen_ai.request.seed", int_or_none(sampling.get("seed")))
    n = int_or_none(sampling.get("n"))
    if n is not None and n != 1:
        a["gen_ai.request.choice.count"] = n
    stop = sampling.get("stop")
    if isinstance(stop, str):
        a["gen_ai.request.stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        a["gen_ai.request.stop_sequences"] = list(stop)


def _usage(a: Attributes, usage: Mapping[str, Any] | None) -> None:
    if not usage:
        return
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    put(a, "gen_ai.usage.input_tokens", int_or_none(usage.get("input_tokens", prompt)))
    put(a, "gen_ai.usage.output_tokens", int_or_none(usage.get("output_tokens", completion)))
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    put(
        a, "gen_ai.usage.cache_read.input_tokens", int_or_none(cached or usage.get("cached_tokens"))
    )
    details = usage.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, Mapping) else None
    put(a, "gen_ai.usage.reasoning.output_tokens", int_or_none(reasoning))


def _server(a: Attributes, upstream: str | None) -> None:
    if not upstream:
        return
    try:
        parts = urlsplit(upstream)
        host, port = parts.hostname, parts.port
    except ValueError:
        return
    put(a, "server.address", host)
    put(a, "server.port", port)


def segment_event(span: trace.Span, segment: Mapping[str, Any]) -> None:
    start = _float(segment.get("start"))
    if start is None:
        return
    attributes: Attributes = {}
    put(attributes, "gen_ai.response.id", segment.get("request_id"))
    put(attributes, "http.response.status_code", int_or_none(segment.get("http_status")))
    put(attributes, "gen_ai.response.finish_reason", segment.get("finish_reason"))
    put(attributes, RL_VERSION, segment.get("weight_version"))
    put(
        attributes, "trace_proxy.segment.carried_tokens", int_or_none(segment.get("carried_tokens"))
    )
    put(attributes, "trace_proxy.segment.tokens", int_or_none(segment.get("tokens")))
    put(attributes, "trace_proxy.segment.end_ns", _maybe_ns(_float(segment.get("end"))))
    span.add_event("segment", attributes=attributes, timestamp=ns(start))


def root_error(failed: list[Generation], calls: int) -> str:
    if not failed:
        return "trajectory status is error"
    first = error_text(failed[0].error) or "error"
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return f"{len(failed)} of {calls} calls failed; call {failed[0].index}: {first}{more}"


def describe(error: CallError) -> str:
    return f"{error.type}: {error.message}"


def put(a: Attributes, name: str, value: Any) -> None:
    if value is not None:
        a[name] = value


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _maybe_ns(seconds: float | None) -> int | None:
    return None if seconds is None else ns(seconds)


def _tag(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def json_text(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


def _json_or_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def content_size(attributes: Attributes) -> int:
    return sum(len(v) for v in attributes.values() if isinstance(v, str))
