"""`trace-proxy demo` and `trace-proxy show` as a new user runs them, and the demo's agent as a
newcomer reads it: the right tool with the question's own arguments, sometimes a plausible
mistake, answers that follow from the tool results, rewards a verifier would give."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from support.proxies import events, trajectories

from trace_proxy.demo.simulated_vllm import TextModel
from trace_proxy.demo.simulated_vllm.policy import lookups_in, mistaken
from trace_proxy.demo.tasks import TASKS, TOOLS, Task, evaluate, reward_of, run_tool, weather
from trace_proxy.store.readers import iter_records
from trace_proxy.trajectories.rewards import merged_outcome

TASK_BY_QUESTION = {task.question: task for task in TASKS}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One `trace-proxy demo` run, read by the tests below (it takes a while)."""
    work = tmp_path_factory.mktemp("demo")
    output = work / "traces"
    demo = subprocess.run(
        [sys.executable, "-m", "trace_proxy", "demo", "--output", str(output)],
        capture_output=True, text=True, timeout=120, cwd=work,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    return output, demo.stdout


def test_demo_writes_the_store_and_show_reads_it(demo_run: tuple[Path, str]) -> None:
    output, stdout = demo_run
    assert "Recorded 16 trajectories" in stdout
    assert f"trace-proxy show {output}" in stdout

    recorded = trajectories(output)
    assert len(recorded) == 16
    keys = {(t["key"]["step"], t["key"]["sample_index"], t["key"]["rollout_n"]) for t in recorded}
    assert keys == {(s, i, n) for s in (1, 2) for i in range(4) for n in range(2)}
    calls = [c for t in recorded for c in t["calls"]]
    assert {c["stream"] for c in calls} == {True, False}
    assert all(c["http_status"] == 200 and c["error"] is None for c in calls)
    assert all(c["prompt"]["token_ids"] and c["outputs"][0]["token_ids"] for c in calls)
    assert any(o["tool_calls"] for c in calls for o in c["outputs"])
    assert {t["close_reason"] for t in recorded if t["key"]["step"] == 1} == {"step_change"}
    # Multi-turn trajectories store later prompts as a suffix of the previous call.
    assert any(c["prompt"]["prefix_call"] is not None for c in calls)
    finish = [e for e in events(output) if e["event"] == "weight_update_finish"]
    assert [e["weight_version"] for e in finish] == ["v2"]
    secret = b"demo-key-never-recorded"
    assert all(secret not in p.read_bytes() for p in output.rglob("*.jsonl"))

    shown = subprocess.run(
        [sys.executable, "-m", "trace_proxy", "show", str(output), "--step", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0
    assert "demo · step 2 · sample 0 · rollout 0" in shown.stdout
    assert "tool_call " in shown.stdout
    assert shown.stdout.strip().endswith(f"8 trajectories, 0 step events under {output}")


def _rewarded(output: Path) -> list[dict[str, Any]]:
    """The demo's trajectories with the rewards posted for them applied."""
    records = [r for _, r in iter_records(output)]
    by_id = {r["id"]: r for r in records if r.get("record") == "trajectory"}
    for note in (r for r in records if r.get("record") == "annotation"):
        for target in note.get("trajectories") or []:
            by_id[target].update(merged_outcome(by_id[target], note))
    return [r for r in by_id.values() if r["key"]["experiment"] == "demo"]


def _is_right(task: Task, name: str, arguments: dict[str, Any]) -> bool:
    if task.expression is not None:
        return name == "calculator" and arguments == {"expression": task.expression}
    return name == "get_weather" and arguments.get("city") in task.cities


def test_demo_agent_calls_the_right_tools_and_earns_what_its_answers_deserve(
    demo_run: tuple[Path, str],
) -> None:
    output, _ = demo_run
    right = wrong = 0
    group_rewards: dict[tuple[int, int], set[float]] = defaultdict(set)
    for record in _rewarded(output):
        task = TASK_BY_QUESTION[record["calls"][0]["prompt"]["messages"][1]["content"]]
        numbers = set(re.findall(r"\d+(?:\.\d+)?", task.question))
        all_right = bool(record["tools"])
        for tool in record["tools"]:
            arguments = json.loads(tool["arguments"])
            assert tool["name"] == ("calculator" if task.expression else "get_weather")
            if tool["name"] == "calculator":
                # the question's arithmetic: its operands come from it, a mistake miscopies one
                operands = re.findall(r"\d+(?:\.\d+)?", arguments["expression"])
                assert len(set(operands) - numbers - {"3600"}) <= 1, arguments
            assert tool["result"] == run_tool(tool["name"], tool["arguments"])
            is_right = _is_right(task, tool["name"], arguments)
            right, wrong = right + is_right, wrong + (not is_right)
            all_right = all_right and is_right
        outputs = [o for c in record["calls"] for o in c["outputs"]]
        answer = outputs[-1]["text"]
        assert not outputs[-1]["tool_calls"] and answer
        for tool in record["tools"]:  # the answer states what each tool returned
            result = json.loads(tool["result"])
            stated = (f"= {result['result']}" if "result" in result
                      else f"{result['city']} is {result['temp_c']} C")  # fmt: skip
            assert stated in answer, (stated, answer)
        looked_up = {json.loads(t["arguments"]).get("city") for t in record["tools"]}
        complete = task.expression is not None or looked_up >= set(task.cities)
        assert record["reward"] == reward_of(task, answer)
        assert (record["reward"] == 1.0) == (all_right and complete), (record["tools"], answer)
        key = record["key"]
        group_rewards[(key["step"], key["sample_index"])].add(record["reward"])
    assert right > wrong > 0  # mostly right, sometimes wrong
    assert any(len(rewards) > 1 for rewards in group_rewards.values())


def test_policy_reads_the_question_and_errs_plausibly(qwen_tokenizer: Any) -> None:
    """Over many seeds: the tool each question needs, with its own expression or cities most
    of the time; the mistakes a miscopied operand or a neighbouring city; at times an answer
    without a tool; never the question's words as an argument."""
    model = TextModel(qwen_tokenizer)
    for task in TASKS:
        messages = [{"role": "user", "content": task.question}]
        turns = [model.plan_chat(messages, TOOLS, "auto", seed) for seed in range(100)]
        calls = [json.loads(c) for t in turns for c in re.findall(r"<tool_call>\n(.*)\n", t)]
        right = [c for c in calls if _is_right(task, c["name"], c["arguments"])]
        assert len(right) >= 0.6 * len(calls) and len(right) < len(calls)
        assert {c["name"] for c in calls} == {"calculator" if task.expression else "get_weather"}
        assert all(task.question not in json.dumps(c["arguments"]) for c in calls)
        guesses = [t for t in turns if "<tool_call>" not in t]
        assert 0 < len(guesses) < 25


def test_a_question_without_a_lookup_never_passes_its_first_word(qwen_tokenizer: Any) -> None:
    """Nothing to compute and no city named: the calls still name a word of the question,
    never the one that starts it, and never the whole question where one word is asked."""
    model = TextModel(qwen_tokenizer)
    messages = [{"role": "user", "content": "What should I wear this weekend, given the forecast?"}]
    cities = [
        json.loads(call)["arguments"]["city"]
        for seed in range(50)
        for call in re.findall(
            r"<tool_call>\n(.*)\n", model.plan_chat(messages, TOOLS, "auto", seed)
        )
        if json.loads(call)["name"] == "get_weather"
    ]
    assert cities and "What" not in cities
    assert all(city in messages[0]["content"] for city in cities)


def test_lookups_and_mistakes() -> None:
    assert [(lk.kind, lk.value) for lk in lookups_in("What is 17 * 23 + 4?")] == [
        ("arithmetic", "17 * 23 + 4")
    ]
    for task in TASKS:
        values = [lookup.value for lookup in lookups_in(task.question)]
        assert values == ([task.expression] if task.expression else list(task.cities))
    assert [lk.value for lk in lookups_in("What is the weather in New York?")] == ["New York"]
    assert lookups_in("Tell me a joke.") == []
    rng = random.Random(0)
    for task in TASKS:
        for lookup in lookups_in(task.question):
            for _ in range(20):
                wrong = mistaken(lookup, rng)
                assert wrong != lookup.value
                if task.expression:
                    assert evaluate(wrong) != evaluate(lookup.value)


def test_tools_compute_and_the_verifier_grades_the_answer() -> None:
    assert json.loads(run_tool("calculator", '{"expression": "17 * 23 + 4"}'))["result"] == 395
    assert json.loads(run_tool("calculator", '{"expression": "2 ^ 16"}'))["result"] == 65536
    assert json.loads(run_tool("calculator", '{"expression": "(12 + 19 + 44) / 3"}')) == {
        "expression": "(12 + 19 + 44) / 3", "result": 25}  # fmt: skip
    for bad in ("__import__('os')", "2 ** 999", "1 / 0", "True + 1", "17 *"):
        assert run_tool("calculator", json.dumps({"expression": bad})).startswith("Error")
    assert run_tool("calculator", "{not json").startswith("Error")
    assert run_tool("search", "{}").startswith("Error")
    task = TASK_BY_QUESTION["What is 17 * 23 + 4?"]
    assert reward_of(task, "17 * 23 + 4 = 395. The answer is 395.") == 1.0
    assert reward_of(task, "17 * 32 + 4 = 548. The answer is 548.") == 0.0
    assert reward_of(task, None) == 0.0
    paris, oslo = weather("Paris")["temp_c"], weather("Oslo")["temp_c"]
    task = TASK_BY_QUESTION["Is it warmer in Paris or in Oslo right now?"]
    assert reward_of(task, f"Paris is {paris} C; Oslo is {oslo} C.") == 1.0
    assert reward_of(task, f"Paris is {paris} C; Bergen is {oslo} C.") == 0.5
    assert reward_of(task, f"Paris is {paris + 1} C; Oslo is {oslo + 1} C.") == 0.0
