"""An SFT row of a token-in trajectory is the whole conversation the model saw: every turn a
later prompt adds between two answers (tool results, the user's next question) is a message,
so that the row's messages, rendered with the model's chat template, give back the last
prompt's text and its answer.

Conversations are made as a token agent makes them (verl's tool agent loop, slime): the first
prompt rendered once by the real Qwen tokenizer's chat template, then each prompt is the one
before, the model's answer ids and the ids of what the agent adds. They go through what a
proxy does to a trajectory (prefix sharing, token2text or an export's `--tokenizer`, the
store's JSON), then through the SFT form.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from groundtruth.clients import (
    Sampling,
    completions_body,
    post,
    read_completions,
    read_sglang_generate,
    read_text_completions,
    read_vllm_generate,
    sglang_generate_body,
    vllm_generate_body,
)
from groundtruth.tooling import TOOLS as GROUNDTRUTH_TOOLS
from groundtruth.tooling import execute, parse_tool_calls
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.proxies import running_proxy

from trace_proxy.dataset.sft import decode_missing, sft_row
from trace_proxy.demo.tokenizer import ensure_qwen_tokenizer
from trace_proxy.text.token2text import Token2Text, Tokenizers, decoder_for
from trace_proxy.text.toolparsers import get_parser
from trace_proxy.trajectories.prompts import share_prefixes
from trace_proxy.trajectories.record import (
    GenerateCall,
    Output,
    Prompt,
    RolloutKey,
    Trajectory,
    dumps,
)

HERMES = get_parser("hermes")
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "calculator", "search")
]
FRENCH = "Thanks! Now say it once more in French…"


@dataclass
class Made:
    """A token-in trajectory as a store holds it, and what its last call saw and said."""

    record: dict[str, Any]
    last_prompt: str  # the last prompt's text
    last_answer: str  # the last answer's text, special tokens kept


def stored(
    calls: list[GenerateCall], tokenizer: Any, decoded_by: str, parser: Any = HERMES
) -> dict[str, Any]:
    """The trajectory's record as the store holds it: prefixes shared as the assembler shares
    them, decoded by token2text when the proxy had a tokenizer, else at export time."""
    share_prefixes(calls)
    trajectory = Trajectory(
        id="t", key=RolloutKey(project="p", experiment="e", step=1), start=0.0,
        end=float(len(calls)), status="ok", close_reason="done", calls=calls,
    )  # fmt: skip
    decode = decoder_for(tokenizer, skip_special_tokens=False)
    if decoded_by == "token2text":
        tokenizers = Tokenizers()
        tokenizers.add(None, decode)
        Token2Text(tokenizers, parser, check_drift=False).process([trajectory])
    record: dict[str, Any] = orjson.loads(dumps(trajectory))
    if decoded_by == "export":
        decode_missing(record, decode)
    return record


def token_calls(prompts: list[list[int]], answers: list[list[int]]) -> list[GenerateCall]:
    return [
        GenerateCall(
            index=n, dialect="vllm.generate", route="/inference/v1/generate", upstream="u",
            start=float(n), end=n + 0.5, prompt=Prompt(token_ids=list(prompt)),
            outputs=[Output(index=0, token_ids=list(answer), finish_reason="stop")],
        )
        for n, (prompt, answer) in enumerate(zip(prompts, answers, strict=True))
    ]  # fmt: skip


def agent_trajectory(
    tokenizer: Any, messages: list[dict[str, Any]], decoded_by: str, newline: bool = True
) -> Made:
    """A call per assistant message of `messages`: its prompt the one before, the answer's
    ids and what the template writes up to the next generation prompt; the answer what the
    template writes for the assistant message, up to its end-of-turn token. `newline=False`:
    the agent adds its turns right after the answer's `<|im_end|>`, as verl's loop does."""

    def render(upto: int, generation: bool) -> str:
        text: str = tokenizer.apply_chat_template(
            messages[:upto], tools=TOOLS, tokenize=False, add_generation_prompt=generation
        )
        return text

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    turns = [n for n, m in enumerate(messages) if m["role"] == "assistant"]
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    seen = ""  # the text of the prompt and answer so far
    for n in turns:
        asked = render(n, True)
        assert asked.startswith(seen), "the template re-renders what came before"
        added = asked[len(seen) :]
        if prompts and not newline:
            added = added.removeprefix("\n")
        prompt = encode(added) if not prompts else [*prompts[-1], *answers[-1], *encode(added)]
        written = render(n + 1, False)[len(asked) :]
        answer = written[: written.rindex("<|im_end|>") + len("<|im_end|>")]
        prompts.append(prompt)
        answers.append(encode(answer))
        seen = asked + answer
    record = stored(token_calls(prompts, answers), tokenizer, decoded_by)
    decode = decoder_for(tokenizer, skip_special_tokens=False)
    return Made(record, decode(prompts[-1]), decode(answers[-1]))


def rendered(tokenizer: Any, row: dict[str, Any]) -> str:
    """The row's messages as the model's chat template writes them (the tools are in the
    system turn the row holds, as the first prompt wrote them)."""
    text: str = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    return text


# --- conversations ---------------------------------------------------------------------------

words = st.text(
    alphabet=st.characters(categories=("L", "N", "P", "Zs"), exclude_characters="<>"),
    min_size=1, max_size=24,
).map(lambda s: unicodedata.normalize("NFC", s))  # fmt: skip
said = st.lists(words, min_size=1, max_size=3).map("\n".join).map(str.strip).filter(bool)
arguments = st.dictionaries(
    st.sampled_from(["city", "unit", "expression", "query", "top_k"]),
    st.one_of(words, st.integers(-1000, 1000)),
    max_size=3,
)
tool_call = st.builds(
    lambda name, args: {
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    },
    st.sampled_from(["get_weather", "calculator", "search"]),
    arguments,
)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A system turn (or none), a question, then answers; after an answer with tool calls its
    results, and maybe the user's next words; after one without, the user's next words."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(said)})
    messages.append({"role": "user", "content": draw(said)})
    for turn in range(draw(st.integers(1, 4))):
        calls = draw(st.lists(tool_call, max_size=2))
        content = draw(st.one_of(st.none(), said)) if calls else draw(said)
        messages.append({"role": "assistant", "content": content, "tool_calls": calls or None})
        if turn == 0 or not draw(st.booleans()):  # the conversation goes on
            messages += [{"role": "tool", "content": draw(said)} for _ in calls]
            if not calls or draw(st.booleans()):
                messages.append({"role": "user", "content": draw(said)})
    if messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": draw(said), "tool_calls": None})
    return messages


@dataclass(frozen=True)
class Qwen:
    """The tokenizer, named in a failing example's report instead of listed token by token."""

    tokenizer: Any = field(repr=False)


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer: Any) -> Qwen:
    return Qwen(qwen_tokenizer)


@pytest.mark.parametrize("decoded_by", ["token2text", "export"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations())
def test_a_token_conversation_rendered_again_is_the_last_prompt_and_its_answer(
    qwen: Qwen, decoded_by: str, messages: list[dict[str, Any]]
) -> None:
    made = agent_trajectory(qwen.tokenizer, messages, decoded_by)
    row = sft_row(made.record, HERMES)
    # The template writes a newline after the last answer's end-of-turn token.
    assert rendered(qwen.tokenizer, row) == made.last_prompt + made.last_answer + "\n"
    got = row["messages"]
    if messages[0]["role"] != "system":  # the template writes one for the tools
        messages = [{"role": "system", "content": got[0]["content"]}, *messages]
    assert [m["role"] for m in got] == [m["role"] for m in messages]
    assert not any(m["unparsed"] for m in got)
    assert [m["content"] for m in got[1:]] == [m["content"] for m in messages[1:]]
    assert "<tools>" in got[0]["content"]
    for mine, theirs in zip(got, messages, strict=True):
        calls = [c["function"] for c in theirs.get("tool_calls") or []]
        assert [c["function"] for c in mine["tool_calls"] or []] == calls
    asked: list[str] = []
    for message in got:  # each result paired, in order, with a call of the answer before it
        if message["role"] == "assistant":
            asked = [c["id"] for c in message["tool_calls"] or []]
        elif message["role"] == "tool":
            assert message["tool_call_id"] == asked.pop(0)


def test_the_users_next_question_between_two_answers_is_a_message(qwen_tokenizer: Any) -> None:
    """P1 = system + user + tools; P2 = P1 + R1 + the tool's result; P3 = P2 + R2 + the user's
    next question: the question is a user message between the two answers."""
    messages = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Is it raining in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": '{"city": "Oslo", "sky": "rain"}'},
        {"role": "assistant", "content": "Yes, it is raining in Oslo.", "tool_calls": None},
        {"role": "user", "content": FRENCH},
        {"role": "assistant", "content": "Oui, il pleut à Oslo.", "tool_calls": None},
    ]  # fmt: skip
    made = agent_trajectory(qwen_tokenizer, messages, "token2text")
    row = sft_row(made.record, HERMES)
    got = row["messages"]
    assert [m["role"] for m in got] == [
        "system", "user", "assistant", "tool", "assistant", "user", "assistant"
    ]  # fmt: skip
    assert got[5]["content"] == FRENCH and not got[5]["unparsed"]
    assert got[3]["tool_call_id"] == got[2]["tool_calls"][0]["id"]
    assert rendered(qwen_tokenizer, row) == made.last_prompt + made.last_answer + "\n"


def test_turns_added_right_after_the_end_of_turn_token_are_read_all_the_same(
    qwen_tokenizer: Any,
) -> None:
    """verl's loop appends the tool turn's ids right after `<|im_end|>`, without the newline the
    template writes: the turns are the same, only that newline is not in the prompt."""
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "user", "content": FRENCH},
        {"role": "assistant", "content": "Il fait beau à Rome.", "tool_calls": None},
    ]  # fmt: skip
    made = agent_trajectory(qwen_tokenizer, messages, "token2text", newline=False)
    got = sft_row(made.record, HERMES)["messages"]
    assert [(m["role"], m["content"]) for m in got[3:]] == [
        ("tool", "sunny"), ("user", FRENCH), ("assistant", "Il fait beau à Rome.")
    ]  # fmt: skip


@pytest.mark.parametrize("decoded_by", ["token2text", "export"])
def test_a_prompt_that_re_renders_an_answer_is_read_whole(
    qwen_tokenizer: Any, decoded_by: str
) -> None:
    """The agent wrote the model's tool call back as the template writes it (other spacing):
    the last prompt does not repeat the first answer's ids, and the row is what it says."""
    encode = qwen_tokenizer.encode
    first = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
    ]
    prompt = encode(qwen_tokenizer.apply_chat_template(
        first, tools=TOOLS, tokenize=False, add_generation_prompt=True))  # fmt: skip
    answer = encode(
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call><|im_end|>'
    )
    later = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "rain"},
        {"role": "user", "content": FRENCH},
    ]  # fmt: skip
    last_prompt = qwen_tokenizer.apply_chat_template(
        later, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    last_answer = "Il pleut.<|im_end|>"
    calls = token_calls([prompt, encode(last_prompt)], [answer, encode(last_answer)])
    row = sft_row(stored(calls, qwen_tokenizer, decoded_by), HERMES)
    assert [m["role"] for m in row["messages"]] == [
        "system", "user", "assistant", "tool", "user", "assistant"
    ]  # fmt: skip
    assert rendered(qwen_tokenizer, row) == last_prompt + last_answer + "\n"


def test_an_answer_cut_short_and_continued_is_one_assistant_message(qwen_tokenizer: Any) -> None:
    """A response stopped by max_tokens, then continued by a prompt that is the one before and
    that response, with nothing added: the two answers are one."""
    encode = qwen_tokenizer.encode
    prompt = encode("<|im_start|>user\nCount to six.<|im_end|>\n<|im_start|>assistant\n")
    cut, rest = encode("One, two, three"), encode(", four, five, six.<|im_end|>")
    row = sft_row(
        stored(token_calls([prompt, [*prompt, *cut]], [cut, rest]), qwen_tokenizer, "token2text"),
        HERMES,
    )
    assert [(m["role"], m["content"]) for m in row["messages"]] == [
        ("user", "Count to six."), ("assistant", "One, two, three, four, five, six.")
    ]  # fmt: skip


def test_harmony_turns_are_read_as_gpt_oss_writes_them(qwen_tokenizer: Any) -> None:
    """With `--tool-parser gpt_oss`, the turns are harmony messages: a tool's message is the
    result of the call before it, the user's next words a user message."""
    oss = get_parser("gpt_oss")

    def encode(text: str) -> list[int]:
        return list(qwen_tokenizer.encode(text, add_special_tokens=False))

    prompt = encode(
        "<|start|>system<|message|>You are ChatGPT.<|end|><|start|>user<|message|>Weather in "
        "Oslo?<|end|><|start|>assistant"
    )
    asked = encode(
        "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant "
        'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    )
    added = encode(
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        f'{{"sky": "rain"}}<|end|><|start|>user<|message|>{FRENCH}<|end|><|start|>assistant'
    )
    final = encode("<|channel|>final<|message|>Il pleut.<|return|>")
    calls = token_calls([prompt, [*prompt, *asked, *added]], [asked, final])
    got = sft_row(stored(calls, qwen_tokenizer, "token2text", oss), oss)["messages"]
    assert [(m["role"], m["content"]) for m in got] == [
        ("system", "You are ChatGPT."), ("user", "Weather in Oslo?"), ("assistant", None),
        ("tool", '{"sky": "rain"}'), ("user", FRENCH), ("assistant", "Il pleut."),
    ]  # fmt: skip
    assert got[2]["reasoning_content"] == "Look it up."
    [made] = got[2]["tool_calls"]
    assert made["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert (got[3]["tool_call_id"], got[3]["name"]) == (made["id"], "get_weather")
    assert not any(m["unparsed"] for m in got)


# --- text without a chat template the parser knows -------------------------------------------

plain = st.text(
    alphabet=st.characters(categories=("L", "N", "P", "Zs"), exclude_characters="<>|"),
    min_size=1, max_size=40,
).map(lambda s: unicodedata.normalize("NFC", s))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    opening=plain,
    turns=st.lists(st.tuples(plain, plain), min_size=1, max_size=4),
    last=plain,
)
def test_text_prompts_in_any_other_template_keep_every_piece_as_it_was_written(
    opening: str, turns: list[tuple[str, str]], last: str
) -> None:
    """Text completions ("User: ...\\nAssistant:"): the first prompt and each piece a later
    prompt adds between two answers are `user` messages marked unparsed, holding the text as
    written; the answers are assistant messages. Nothing the model saw is left out."""
    texts, answers = [f"User: {opening}\nAssistant:"], []
    for answer, question in turns:
        answers.append(f" {answer}")
        texts.append(f"{texts[-1]}{answers[-1]}\nUser: {question}\nAssistant:")
    answers.append(f" {last}")
    calls = [
        GenerateCall(
            index=n, dialect="openai.completions", route="/v1/completions", upstream="u",
            start=float(n), end=n + 0.5, prompt=Prompt(text=text),
            outputs=[Output(index=0, text=answer, finish_reason="stop")],
        )
        for n, (text, answer) in enumerate(zip(texts, answers, strict=True))
    ]  # fmt: skip
    share_prefixes(calls)
    trajectory = Trajectory(
        id="t", key=RolloutKey(project="p", experiment="e"), start=0.0, end=9.0, status="ok",
        close_reason="done", calls=calls,
    )  # fmt: skip
    row = sft_row(orjson.loads(dumps(trajectory)), HERMES)
    got = row["messages"]
    assert [m["role"] for m in got] == ["user", "assistant"] * len(texts)
    pieces = [texts[0], *(f"\nUser: {q}\nAssistant:" for _, q in turns)]
    assert [m["content"] for m in got if m["role"] == "user"] == pieces
    assert all(m["unparsed"] for m in got if m["role"] == "user")
    assert [m["content"] for m in got if m["role"] == "assistant"] == [
        HERMES.parse_response(a).content for a in answers
    ]
    assert not any(m["unparsed"] for m in got if m["role"] == "assistant")


# --- through a proxy, in every token-in dialect ----------------------------------------------

QUESTION = "Is it raining in Oslo?"
SYSTEM = "You are a helpful agent. Use the tools."


@dataclass
class Dialect:
    """How one client shape asks the model: token ids or text in, the answer's ids or text back
    (text: a text completion, read with special tokens kept, as skyrl-train asks for it)."""

    name: str
    route: str
    text: bool = False

    def body(self, prompt: Any, seed: int) -> dict[str, Any]:
        sampling = Sampling(96, 1.0, seed)
        if self.name == "vllm.generate":
            return vllm_generate_body(prompt, sampling, False, None)
        if self.name == "sglang.generate":
            return sglang_generate_body(prompt, sampling, False, None)
        if self.text:
            return {"model": "tiny-qwen", "prompt": prompt, "max_tokens": 96, "seed": seed,
                    "skip_special_tokens": False}  # fmt: skip
        return completions_body(prompt, sampling, False, False, None)

    def answer(self, payload: bytes) -> Any:
        if self.name == "vllm.generate":
            return read_vllm_generate(payload, False).token_ids
        if self.name == "sglang.generate":
            return read_sglang_generate(payload, False).token_ids
        if self.text:
            return read_text_completions(payload)[0].content
        return read_completions(payload, False, False).token_ids


VLLM_DIALECTS = [
    Dialect("vllm.generate", "/inference/v1/generate"),
    Dialect("openai.completions", "/v1/completions"),
    Dialect("openai.completions.text", "/v1/completions", text=True),
]
SGLANG_DIALECTS = [Dialect("sglang.generate", "/generate")]


async def three_calls(
    session: aiohttp.ClientSession, proxy: str, tokenizer: Any, dialect: Dialect, sample: int
) -> tuple[list[str], str, str]:
    """P1 = system + user + tools; P2 = P1 + R1 + the tool results R1 asked for; P3 = P2 + R2
    (+ its tool results) + the user's next question. The roles the conversation has, and the
    last prompt's and answer's text."""
    head = {"X-Rollout-Experiment": "dialects", "X-Rollout-Step": "1",
            "X-Rollout-Sample-Index": str(sample), "X-Rollout-N": "0"}  # fmt: skip
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(
        first, tools=GROUNDTRUTH_TOOLS, tokenize=False, add_generation_prompt=True
    )
    decode = decoder_for(tokenizer, skip_special_tokens=False)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    prompt: Any = text if dialect.text else encode(text)
    roles = ["system", "user"]
    for turn in range(3):
        payload = await post(session, proxy + dialect.route, dialect.body(prompt, turn), head)
        answer = dialect.answer(payload)
        said = answer if dialect.text else decode(answer)
        roles.append("assistant")
        if turn == 2:
            return roles, prompt if dialect.text else decode(prompt), said
        results = [execute(c.name, c.arguments) for c in parse_tool_calls(said)]
        added = "\n" if said.endswith("<|im_end|>") else "<|im_end|>\n"
        if results:
            blocks = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
            added += f"<|im_start|>user{blocks}<|im_end|>\n"
            roles += ["tool"] * len(results)
        if turn == 1:
            added += f"<|im_start|>user\n{FRENCH}<|im_end|>\n"
            roles.append("user")
        added += "<|im_start|>assistant\n"
        prompt = prompt + said + added if dialect.text else [*prompt, *answer, *encode(added)]
    raise AssertionError("unreachable")


async def plain_text_calls(session: aiohttp.ClientSession, proxy: str) -> list[str]:
    """Text completions in a template of the client's own: each prompt the one before, its
    answer and the next question. The pieces each prompt added, and the answers."""
    head = {"X-Rollout-Experiment": "dialects", "X-Rollout-Step": "1",
            "X-Rollout-Sample-Index": "99", "X-Rollout-N": "0"}  # fmt: skip
    pieces = [f"User: {QUESTION}\nAssistant:"]
    prompt = pieces[0]
    for turn, question in enumerate(["And then?", FRENCH, None]):
        body = {"model": "tiny-qwen", "prompt": prompt, "max_tokens": 40, "seed": turn}
        [reply] = read_text_completions(await post(session, proxy + "/v1/completions", body, head))
        pieces.append(reply.content or "")
        if question is not None:
            pieces.append(f"\nUser: {question}\nAssistant:")
            prompt += pieces[-2] + pieces[-1]
    return pieces


def exported(output: Path, out: Path) -> tuple[dict[int, dict[str, Any]], str]:
    """The SFT rows of a store, by sample, as `datasets` reads the export's files, and the
    export's summary."""
    datasets = pytest.importorskip("datasets")
    from trace_proxy.dataset.build import write_dataset
    from trace_proxy.dataset.reading import Selection

    written = write_dataset(output, out, "sft", Selection())
    files = sorted(str(p) for p in out.glob("*.parquet"))
    rows = datasets.load_dataset("parquet", data_files=files, split="train")
    return {row["sample_index"]: dict(row) for row in rows}, written.tally.describe()


@pytest.mark.parametrize("upstream", ["vllm", "sglang"])
async def test_each_token_dialects_row_renders_as_the_last_prompt_and_its_answer(
    qwen_tokenizer: Any,
    fake_vllm: tuple[Any, str],
    fake_sglang: tuple[Any, str],
    tmp_path: Path,
    upstream: str,
) -> None:
    pytest.importorskip("pyarrow")
    url = (fake_vllm if upstream == "vllm" else fake_sglang)[1]
    dialects = VLLM_DIALECTS if upstream == "vllm" else SGLANG_DIALECTS
    settings = {"token2text": True, "tokenizer": [str(ensure_qwen_tokenizer())]}
    sent = {}
    async with (
        running_proxy([url], tmp_path / "out", **settings) as (_, proxy),
        aiohttp.ClientSession() as session,
    ):
        for sample, dialect in enumerate(dialects):
            sent[sample] = await three_calls(session, proxy, qwen_tokenizer, dialect, sample)
        if upstream == "vllm":
            plain = await plain_text_calls(session, proxy)
    rows, summary = exported(tmp_path / "out", tmp_path / "sft")
    unparsed = "trajectories with prompt text in no chat template the tool parser knows"
    assert (f"1 {unparsed}" in summary) == (upstream == "vllm"), summary
    for sample, (roles, last_prompt, last_answer) in sent.items():
        row, name = rows[sample], dialects[sample].name
        messages = row["messages"]
        assert "tool" in roles and [m["role"] for m in messages] == roles, name
        assert [m["content"] for m in messages if m["role"] == "user"] == [QUESTION, FRENCH]
        assert not any(m["unparsed"] for m in messages)
        # The template ends the answer's turn: what the answer did not write of `<|im_end|>\n`.
        end = "\n" if last_answer.endswith("<|im_end|>") else "<|im_end|>\n"
        text = qwen_tokenizer.apply_chat_template(messages, tokenize=False)
        assert text == last_prompt + last_answer + end, name
    if upstream == "vllm":
        messages = rows[99]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3
        users = [m for m in messages if m["role"] == "user"]
        assert [m["content"] for m in users] == plain[0::2] and all(m["unparsed"] for m in users)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert answers == [HERMES.parse_response(a).content for a in plain[1::2]]
