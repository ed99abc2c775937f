"""The simulated policy's judgement: which lookups a question needs, and what it answers.

A newcomer reads the demo's traces as an agent's: a calculator asked for the question's own
arithmetic, the weather asked for the cities the question names, an answer that follows from
what the tools returned. Like a small model being trained, it sometimes gets a call wrong (an
operand or an operator, a neighbouring city) or answers from memory without a tool, seeded by
the request, so the rollouts of one GRPO group earn different rewards.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .chatml import ascii_text, message_text
from .wire import JSON

MISTAKE_RATE = 0.2  # a call's argument taken wrong
GUESS_RATE = 0.1  # answering at once, from memory, when a tool was needed
PARALLEL_RATE = 0.5  # several lookups asked in one turn rather than one per turn
ARITHMETIC = "arithmetic"
PLACE = "place"
_PARAMETERS = {
    ARITHMETIC: ("expression", "expr", "formula", "math"),
    PLACE: ("city", "location", "place", "town"),
}
_NUMBER = r"\d+(?:\.\d+)?"
_EXPRESSION = re.compile(rf"\(*\s*{_NUMBER}(?:\s*[-+*/^]\s*\(*\s*{_NUMBER}\s*\)*)+")
_POWER = re.compile(rf"({_NUMBER}) to the power of ({_NUMBER})", re.IGNORECASE)
_AVERAGE = re.compile(rf"(?:average|mean) of ({_NUMBER}(?:\s*(?:,|and)\s*{_NUMBER})+)", re.I)
_UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}
_CONVERSION = re.compile(
    rf"(second|minute|hour|day|week)s?\s+(?:are\s+there\s+)?in\s+({_NUMBER})\s+"
    r"(second|minute|hour|day|week)s?",
    re.IGNORECASE,
)
_CAPITALIZED = re.compile(r"[A-Z][a-z]+(?:\s+[A-Z][a-z]+)*")
_NEIGHBOURS = {
    "Paris": "Lyon", "Oslo": "Bergen", "London": "Manchester", "Tokyo": "Kyoto",
    "Sydney": "Melbourne", "Rome": "Milan", "Berlin": "Hamburg", "Madrid": "Barcelona",
}  # fmt: skip
_ANY_CITIES = ("Lisbon", "Vienna", "Dublin", "Prague", "Athens", "Cairo", "Lima", "Perth")


@dataclass(frozen=True)
class Lookup:
    """One thing the question needs looked up: an expression to compute or a place."""

    kind: str  # ARITHMETIC | PLACE
    value: str


def lookups_in(question: str) -> list[Lookup]:
    """The arithmetic the question asks for, else the places it names."""
    expression = arithmetic_in(question)
    if expression is not None:
        return [Lookup(ARITHMETIC, expression)]
    return [Lookup(PLACE, place) for place in places_in(question)]


def arithmetic_in(question: str) -> str | None:
    """The question's arithmetic as a calculator expression, or None."""
    if match := _POWER.search(question):
        return f"{match[1]} ^ {match[2]}"
    if match := _AVERAGE.search(question):
        numbers = re.findall(_NUMBER, match[1])
        return f"({' + '.join(numbers)}) / {len(numbers)}"
    if match := _CONVERSION.search(question):
        small, amount, big = match[1].lower(), match[2], match[3].lower()
        if _UNITS[big] > _UNITS[small]:
            return f"{amount} * {_UNITS[big] // _UNITS[small]}"
    if match := _EXPRESSION.search(question):
        expression = " ".join(match[0].split())
        if expression.count("(") == expression.count(")"):
            return re.sub(r"\s*([-+*/^])\s*", r" \1 ", expression)
    return None


def places_in(question: str) -> list[str]:
    """Capitalized names that do not start a sentence: the places a question mentions."""
    places: list[str] = []
    for match in _CAPITALIZED.finditer(question):
        before = question[: match.start()].rstrip()
        if not before or before[-1] in ".?!:\"'":
            continue
        if match[0] not in places:
            places.append(match[0])
    return places


def _tool_for(kind: str, functions: Sequence[JSON]) -> tuple[JSON, str] | None:
    """The function taking this kind of lookup, and its parameter for it."""
    for function in functions:
        properties = (function.get("parameters") or {}).get("properties") or {}
        for name in _PARAMETERS[kind]:
            if name in properties:
                return function, name
    return None


def planned_calls(
    question: str, functions: Sequence[JSON]
) -> list[tuple[JSON, str, Lookup]] | None:
    """(function, parameter, lookup) for each lookup the question needs, or None when the
    question needs none, or the tools offered cannot make one of them."""
    lookups = lookups_in(question)
    planned = []
    for lookup in lookups:
        tool = _tool_for(lookup.kind, functions)
        if tool is None:
            return None
        planned.append((tool[0], tool[1], lookup))
    return planned or None


def mistaken(lookup: Lookup, rng: random.Random) -> str:
    """A plausible wrong value: an operand or operator miscopied, a neighbouring city."""
    if lookup.kind == PLACE:
        return _NEIGHBOURS.get(lookup.value) or rng.choice(
            [c for c in _ANY_CITIES if c != lookup.value]
        )
    numbers = list(re.finditer(_NUMBER, lookup.value))
    operators = list(re.finditer(r" ([-+*]) ", lookup.value))
    if operators and rng.random() < 0.3:
        match = rng.choice(operators)
        swapped = {"+": "-", "-": "+", "*": "+"}[match[1]]
        return f"{lookup.value[: match.start(1)]}{swapped}{lookup.value[match.end(1) :]}"
    match = rng.choice(numbers)
    digits = match[0]
    if len(digits) > 1 and digits.endswith("0"):
        wrong = digits[:-1]  # a zero dropped
    elif digits != digits[::-1]:
        wrong = digits[::-1]  # digits swapped
    else:
        wrong = str(int(float(digits)) + 1)
    return f"{lookup.value[: match.start()]}{wrong}{lookup.value[match.end() :]}"


def guess(question: str, rng: random.Random) -> str:
    """An answer from memory, without the tool the question needed."""
    lookups = lookups_in(question)
    if lookups and lookups[0].kind == ARITHMETIC:
        return f"That comes to about {rng.randint(10, 999) * 10}."
    parts = [f"{lookup.value} is about {rng.randint(5, 30)} C" for lookup in lookups]
    return "I think " + "; ".join(parts) + "."


def answer_from(results: Sequence[str], asked: Sequence[JSON]) -> str | None:
    """The answer the tool results give (a result that leaves out its city or expression
    read with the arguments it was asked with), or None when they are not results this
    policy knows (then the model answers generically)."""
    facts: list[str] = []
    temperatures: list[tuple[float, str]] = []
    value: str | None = None
    for position, result in enumerate(results):
        args = asked[position] if position < len(asked) else {}
        try:
            data = json.loads(result)
        except ValueError:
            if not result.lower().startswith("error"):
                return None  # plain text: read as it is, no fact taken from it
            facts.append(f"A lookup failed ({ascii_text(result, 60)})")
            continue
        if not isinstance(data, dict):
            return None
        if "result" in data:
            value = ascii_text(_number(data["result"]), 40)
            expression = data.get("expression") or args.get("expression") or "It"
            facts.append(f"{ascii_text(expression, 60)} = {value}")
        elif "temp_c" in data:
            place = ascii_text(data.get("city") or args.get("city") or "It", 40)
            sky = f" and {ascii_text(data['sky'], 20)}" if data.get("sky") else ""
            facts.append(f"{place} is {ascii_text(_number(data['temp_c']), 20)} C{sky}")
            if isinstance(data["temp_c"], int | float) and place != "It":
                temperatures.append((float(data["temp_c"]), place))
        else:
            return None
    if not facts:
        return None
    text = "; ".join(facts) + "."
    if value is not None:
        return f"{text} The answer is {value}."
    if len(temperatures) > 1:
        top = max(temperatures)
        if [t for t, _ in temperatures].count(top[0]) > 1:
            return f"{text} None of them is warmer than the others."
        warmest = "warmer" if len(temperatures) == 2 else "the warmest"
        return f"{text} {top[1]} is {warmest}."
    if any("rain" in fact for fact in facts):
        return f"{text} Rain is expected: take an umbrella."
    return f"{text} No rain is expected."


def asked_arguments(messages: Sequence[JSON]) -> list[JSON]:
    """The arguments of each tool call in these messages, in order ({} where unreadable);
    a call read back from ChatML holds the whole `{"name", "arguments"}` text."""
    asked: list[JSON] = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            asked.append(_arguments_of(function))
    return asked


def _arguments_of(function: object) -> JSON:
    try:
        if isinstance(function, str):
            function = json.loads(function)
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def _number(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def user_question(messages: Sequence[JSON]) -> tuple[str, int]:
    """The latest user message's text, and where it sits in the conversation."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            return message_text(messages[index].get("content")), index
    return "", -1
