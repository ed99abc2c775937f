"""`trace-proxy demo`'s options, apart from the run (demo/run.py), so that the CLI imports
nothing heavy."""

from __future__ import annotations

from typing import Any

from trace_proxy.commandline import LOG_FORMAT, run_coroutine, usage_error
from trace_proxy.config import ConfigError, add_options, resolve
from trace_proxy.logtext import configure_logging

SIZES = ("samples", "rollouts", "steps")  # the rollout's size, beside the proxy's options


def add_demo_command(commands: Any) -> None:
    """Register `trace-proxy demo [--samples N] [--rollouts N] [--steps N] ...`."""
    demo = commands.add_parser(
        "demo",
        help="run a simulated vLLM server and a tool-calling agent through the proxy",
        description="Start a simulated vLLM server (real Qwen tokenizer, built offline), run a "
        "small multi-turn tool-calling RL rollout through the proxy, and write the store.",
    )
    add_options(demo, "demo")
    demo.add_argument("--samples", type=int, default=4, help="samples per step [default: 4]")
    demo.add_argument("--rollouts", type=int, default=2, help="rollouts per sample [default: 2]")
    demo.add_argument("--steps", type=int, default=2, help="training steps [default: 2]")


def run_demo_command(args: dict[str, Any]) -> int:
    sizes = {name: args.pop(name) for name in SIZES}
    try:
        settings = resolve("demo", args)
    except ConfigError as exc:
        return usage_error(str(exc))
    configure_logging(LOG_FORMAT, settings.log_level)
    from trace_proxy.demo.run import run_demo

    try:
        return run_coroutine(run_demo(settings, **sizes))
    except ConfigError as exc:
        return usage_error(str(exc))
