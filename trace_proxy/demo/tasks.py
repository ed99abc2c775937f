"""The demo's environment: its tasks, the tools the agent runs, and the verifier's reward.

The tools compute real answers (the calculator evaluates the expression it is given, the
weather is fixed per city), and each task knows the right calls, so the verifier grades the
final answer against what those calls return: a rollout that asked for the wrong operand or
the wrong city answers wrongly and earns less than its siblings.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
]


@dataclass(frozen=True)
class Task:
    """A question and the tool calls that answer it: cities to look up, or an expression."""

    question: str
    cities: tuple[str, ...] = ()
    expression: str | None = None


TASKS = (
    Task("Is it warmer in Paris or in Oslo right now?", cities=("Paris", "Oslo")),
    Task("What is 17 * 23 + 4?", expression="17 * 23 + 4"),
    Task("Should I take an umbrella in London today?", cities=("London",)),
    Task("How many seconds are there in 3.5 hours?", expression="3.5 * 3600"),
    Task("Compare the weather in Tokyo and Sydney.", cities=("Tokyo", "Sydney")),
    Task("What is the average of 12, 19 and 44?", expression="(12 + 19 + 44) / 3"),
    Task("Is it a good day for a picnic in Rome?", cities=("Rome",)),
    Task("What is 2 to the power of 16?", expression="2 ^ 16"),
)
_SKIES = ("sunny", "cloudy", "rainy")
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.BitXor: operator.pow,  # a calculator's `^`
}
_MAX_EXPONENT = 64


def weather(city: str) -> dict[str, Any]:
    """The (made-up, fixed) weather of a city."""
    temp = sum(map(ord, city)) % 30
    return {"city": city, "temp_c": temp, "sky": _SKIES[temp % 3]}


def evaluate(expression: str) -> float:
    """An arithmetic expression's value: numbers, + - * / ^ ** and parentheses only."""
    return _value(ast.parse(expression, mode="eval").body)


def _value(node: ast.expr) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise ValueError("only numbers, + - * / ^ and parentheses are allowed")
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow | ast.BitXor) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right:g} is too large")
        return float(_OPERATORS[type(node.op)](left, right))
    raise ValueError("only numbers, + - * / ^ and parentheses are allowed")


def run_tool(name: str, arguments: str) -> str:
    """What the environment returns for a tool call (errors as text, as agents pass them on)."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"Error when executing tool: arguments are not JSON ({exc})"
    if not isinstance(args, dict):
        return "Error when executing tool: arguments are not an object"
    if name == "get_weather":
        return json.dumps(weather(str(args.get("city", ""))))
    if name == "calculator":
        expression = str(args.get("expression", ""))
        try:
            result = evaluate(expression)
        except (SyntaxError, ValueError, ArithmeticError, RecursionError) as exc:
            return f"Error when executing tool: {exc}"
        value = int(result) if result.is_integer() else round(result, 4)
        return json.dumps({"expression": expression, "result": value})
    return f"Error when executing tool: unknown tool {name!r}"


def reward_of(task: Task, answer: str | None) -> float:
    """What a verifier says of the final answer: for arithmetic, 1 when its last number is
    the value; for weather, the share of the task's cities whose temperature it states right;
    0 without an answer."""
    if not answer:
        return 0.0
    if task.expression is not None:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
        right = evaluate(task.expression)
        return 1.0 if numbers and abs(float(numbers[-1]) - right) < 1e-3 else 0.0
    stated = 0
    for city in task.cities:
        said = re.search(rf"\b{re.escape(city)} is (?:about )?(-?\d+) C\b", answer)
        stated += bool(said and int(said[1]) == weather(city)["temp_c"])
    return stated / len(task.cities)
