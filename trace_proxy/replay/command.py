"""The `replay` subcommand: its options, their checks, and the summary it ends with."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from trace_proxy.logtext import printable
from trace_proxy.store.replicas import REPLICAS, store_roots

HEADER = re.compile(r"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([^\r\n]*)")
REPLICA_NAME = "replay"  # the replica a replay writes into, in a store that holds replicas
MAX_SHOWN = 10  # failures listed one by one in the summary


def add_replay_command(commands: Any) -> None:
    """Register `trace-proxy replay STORE --upstream URL ...` on the CLI's subparsers."""
    replay = commands.add_parser(
        "replay",
        help="send recorded trajectories' calls to another server and record the answers",
        description="Send the generate calls of recorded trajectories again, each with its "
        "recorded inputs (route, parameters, messages or prompt token ids), to the server "
        "given (a newer checkpoint, say), through a trace-proxy of its own: the answers are "
        "recorded as a new run of the store, each trajectory labelled with the one it replays "
        "(replay_of), and the viewer compares the two side by side.",
    )
    replay.add_argument("store", metavar="STORE", help="the --output directory of serve or demo")
    replay.add_argument("--upstream", required=True, metavar="URL", help="server to send to")
    replay.add_argument(
        "--trajectory", action="append", default=[], metavar="ID",
        help="a trajectory to replay: its record id (as the viewer shows it) or its "
        "trajectory id (repeatable)",
    )  # fmt: skip
    replay.add_argument("--step", type=int, metavar="N", help="replay every trajectory of step N")
    replay.add_argument(
        "--validation", action="store_true",
        help="with --step: the step's validation trajectories",
    )  # fmt: skip
    replay.add_argument(
        "--run", metavar="PROJECT/EXPERIMENT",
        help="the run to read, when the store holds several (the experiment alone will do "
        "when no other project has one of that name)",
    )  # fmt: skip
    replay.add_argument(
        "--model", metavar="NAME",
        help="model name to send instead of the recorded one (a newer checkpoint is "
        "usually served under another name)",
    )  # fmt: skip
    replay.add_argument(
        "--experiment", metavar="NAME",
        help="experiment of the new run [default: the recorded one's name + "
        "-replay-<UTC time>]",
    )  # fmt: skip
    replay.add_argument(
        "--out", metavar="DIR",
        help=f"store to write the new run into [default: STORE, or STORE/{REPLICAS}/"
        f"{REPLICA_NAME} when STORE holds replicas]",
    )  # fmt: skip
    replay.add_argument(
        "--header", action="append", default=[], metavar="'NAME: VALUE'",
        help="header sent with every call, e.g. 'Authorization: Bearer ...' (repeatable; "
        "never written to the store or the log by the replay)",
    )  # fmt: skip
    replay.add_argument(
        "--api-key-env", metavar="VAR",
        help="send 'Authorization: Bearer $VAR' with every call",
    )  # fmt: skip
    replay.add_argument(
        "--body-field", action="append", default=[], metavar="NAME=JSON",
        help="set a top-level field of every request body, e.g. return_token_ids=true: "
        "for request fields the record does not keep (repeatable)",
    )  # fmt: skip
    replay.add_argument(
        "--concurrency", type=int, default=16, metavar="N",
        help="trajectories replayed at once [default: 16]",
    )  # fmt: skip
    replay.add_argument(
        "--token2text", action="store_true",
        help="decode the new run's token ids to text, as serve --token2text does",
    )  # fmt: skip
    replay.add_argument(
        "--tokenizer", action="append", default=[], metavar="PATH",
        help="tokenizer for --token2text, as serve --tokenizer (repeatable)",
    )  # fmt: skip


def run_replay_command(args: dict[str, Any]) -> int:
    """Check the options, replay, print the summary. Exit code 2 for what the user must fix,
    1 when a call failed (or records could not be written), else 0."""
    from trace_proxy.config import ConfigError
    from trace_proxy.replay.selection import ReplayError, select
    from trace_proxy.replay.session import ReplayPlan, replay
    from trace_proxy.text.token2text import TokenizerError

    try:
        plan_args = _checked(args)
        run, trajectories = select(
            Path(args["store"]),
            run_name=args["run"],
            trajectory_ids=args["trajectory"],
            step=args["step"],
            validation=args["validation"],
        )
        plan = ReplayPlan(
            experiment=args["experiment"] or default_experiment(run.experiment), **plan_args
        )
        report = asyncio.run(replay(run, trajectories, plan))
    except (ReplayError, ConfigError, TokenizerError) as exc:
        print(f"trace-proxy: error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the proxy was stopped first: what was answered is recorded
        print("trace-proxy replay: interrupted; the calls answered so far are recorded",
              file=sys.stderr)  # fmt: skip
        return 130
    print_report(report, Path(args["store"]), run.name, len(trajectories))
    return 1 if report.failed or report.left_in_spool else 0


def _checked(args: dict[str, Any]) -> dict[str, Any]:
    """The plan's fields from the options, each checked: ReplayError names the first wrong."""
    from trace_proxy.config import parse_upstream
    from trace_proxy.replay.selection import ReplayError

    try:
        upstream = parse_upstream(args["upstream"])
    except ValueError as exc:
        raise ReplayError(f"invalid value for --upstream: {exc}") from None
    if args["concurrency"] < 1:
        raise ReplayError("invalid value for --concurrency: at least 1")
    if args["experiment"] is not None and not _name_ok(args["experiment"]):
        raise ReplayError("invalid value for --experiment: 1-256 printable characters")
    if args["model"] is not None and not args["model"]:
        raise ReplayError("invalid value for --model: a name")
    headers = {}
    for given in args["header"]:
        match = HEADER.fullmatch(given)
        if match is None:  # the value is not repeated: it may be a secret
            raise ReplayError("invalid value for --header: expected 'NAME: VALUE' on one line")
        headers[match[1]] = match[2]
    if args["api_key_env"] is not None:
        key = os.environ.get(args["api_key_env"])
        if not key:
            raise ReplayError(f"--api-key-env: the variable {args['api_key_env']} is not set")
        headers["Authorization"] = f"Bearer {key}"
    extra: dict[str, Any] = {}
    for given in args["body_field"]:
        name, equals, value = given.partition("=")
        try:
            if not name or not equals:
                raise ValueError("expected NAME=JSON")
            extra[name] = orjson.loads(value)
        except ValueError as exc:
            raise ReplayError(f"invalid value for --body-field {name!r}: {exc}") from None
    store = Path(args["store"])
    out = Path(args["out"]) if args["out"] else _default_output(store)
    return {
        "upstream": upstream, "output": out, "model": args["model"], "headers": headers,
        "extra": extra, "concurrency": args["concurrency"], "token2text":
        args["token2text"] or bool(args["tokenizer"]), "tokenizer": args["tokenizer"],
    }  # fmt: skip


def _name_ok(name: str) -> bool:
    return 0 < len(name) <= 256 and name.isprintable()


def _default_output(store: Path) -> Path:
    """The store itself; in a store of replicas, a replica of the replay's own."""
    return store / REPLICAS / REPLICA_NAME if store_roots(store) != [store] else store


def default_experiment(recorded: str, now: float | None = None) -> str:
    """`<recorded>-replay-<UTC time>`, within the 256 characters a name may have."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    suffix = f"-replay-{stamp}"
    return recorded[: 256 - len(suffix)] + suffix


def print_report(report: Any, store: Path, recorded: str, selected: int) -> None:
    """What was sent, what failed and why, what the store holds now, how to look at it."""
    print(
        f"trace-proxy replay: {selected} trajectories of {printable(recorded)}: "
        f"{report.sent} calls sent, "
        f"{len(report.failed)} failed, {len(report.skipped)} not replayable"
    )
    for kind, items in (("failed", report.failed), ("not replayable", report.skipped)):
        for item in items[:MAX_SHOWN]:
            print(f"  {kind}: trajectory {printable(item.trajectory)} call {item.call}: "
                  f"{printable(item.reason)}")  # fmt: skip
        if len(items) > MAX_SHOWN:
            print(f"  ... and {len(items) - MAX_SHOWN} more {kind}")
    name = printable(f"{report.project}/{report.experiment}")
    print(f"New run {name}: {report.trajectories} trajectories written to {report.output}")
    if report.token_ids_missing:
        print(f"  {report.token_ids_missing} replayed calls came back without the token ids "
              "their recorded call had: the record does not keep `return_token_ids`; send it "
              "with --body-field return_token_ids=true")  # fmt: skip
    if report.left_in_spool is not None:
        print(f"  records not yet written wait in {report.left_in_spool}")
    if report.directory is not None:
        # One viewer over the recorded run and the new one, so that it can compare them.
        output = Path(report.output)
        inside = output == store or output.parent == store / REPLICAS
        stores, number = (str(store), 0) if inside else (f"{store} {output}", 1)
        project, experiment = report.directory.parent.name, report.directory.name
        print(f"Look at it:  trace-proxy ui {stores}  (then /run/{number}/"
              f"{quote(project, safe='')}/{quote(experiment, safe='')}/: a replayed "
              "trajectory's page compares it with the recorded one)")  # fmt: skip
