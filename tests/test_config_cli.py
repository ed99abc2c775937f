"""The CLI contract: every option from flag, env or file; a bad value is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trace_proxy.cli import main
from trace_proxy.config import OPTIONS, ConfigError, resolve


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trace_proxy", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_help_documents_every_serve_option() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for option in OPTIONS:
        if "serve" in option.commands:
            assert option.flag in text
            assert option.env in text
    assert "--config" in text


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["serve"], "--upstream"),
        (["serve", "--upstream", "ftp://x"], "--upstream"),
        (["serve", "--upstream", "http://127.0.0.1:1", "--port", "abc"], "--port"),
        (["serve", "--upstream", "http://127.0.0.1:1", "--port", "70000"], "--port"),
        (["serve", "--upstream", "http://127.0.0.1:1", "--backend", "nope"], "--backend"),
        (["serve", "--upstream", "http://127.0.0.1:1", "--map", "header:X=nofield"], "--map"),
        (["serve", "--upstream", "http://127.0.0.1:1", "--idle-timeout", "-1"], "--idle-timeout"),
        (["serve", "--bogus"], "--bogus"),
    ],
)
def test_invalid_option_is_one_line_naming_it_with_exit_2(args: list[str], named: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert named in lines[0]
    assert lines[0].startswith("trace-proxy: error:")


def test_env_value_is_named_when_invalid() -> None:
    env = {"TRACE_PROXY_PORT": "not-a-port", "TRACE_PROXY_UPSTREAM": "http://127.0.0.1:1"}
    with pytest.raises(ConfigError, match="TRACE_PROXY_PORT"):
        resolve("serve", {}, env)


def test_main_returns_2_on_a_bad_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACE_PROXY_UPSTREAM", "http://127.0.0.1:1")
    monkeypatch.setenv("TRACE_PROXY_IDLE_TIMEOUT", "soon")
    assert main(["serve"]) == 2


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text("port: 9001\nproject: from-file\nexperiment: file-exp\nidle-timeout: 7\n")
    env = {"TRACE_PROXY_PORT": "9002", "TRACE_PROXY_PROJECT": "from-env"}
    settings = resolve("serve", {"config": str(config), "port": "9003"}, env)
    assert settings.port == 9003
    assert settings.project == "from-env"
    assert settings.experiment == "file-exp"
    assert settings.idle_timeout == 7.0


def test_toml_config_and_lists(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        'upstream = ["http://10.0.0.1:8000", "http://10.0.0.2:8000/"]\n'
        'map = ["body:rid=trajectory_id"]\n'
    )
    settings = resolve("serve", {"config": str(config)}, {})
    assert settings.upstream == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert settings.map == ["body:rid=trajectory_id"]


def test_env_list_is_comma_separated() -> None:
    settings = resolve("serve", {}, {"TRACE_PROXY_UPSTREAM": "http://a:1,http://b:2"})
    assert settings.upstream == ["http://a:1", "http://b:2"]


def test_verl_names_are_accepted_in_a_file(tmp_path: Path) -> None:
    config = tmp_path / "verl.yaml"
    config.write_text("trace:\n  project_name: my_project\n  experiment_name: run-7\n")
    settings = resolve("serve", {"config": str(config)}, {})
    assert (settings.project, settings.experiment) == ("my_project", "run-7")


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        ("bogus_option: 1\n", ".yaml", "unknown option 'bogus_option'"),
        ("port: [1, 2\n", ".yaml", "is not valid"),
        ("- a\n- b\n", ".yaml", "mapping"),
        ("port = \n", ".toml", "is not valid"),
        ("port: -5\n", ".yaml", "port"),
    ],
)
def test_bad_config_file(tmp_path: Path, content: str, suffix: str, message: str) -> None:
    config = tmp_path / f"c{suffix}"
    config.write_text(content)
    with pytest.raises(ConfigError, match=message):
        resolve("serve", {"config": str(config)}, {})


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    result = run_cli("serve", "--upstream", "http://x:1", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "--config" in result.stderr and "nope.yaml" in result.stderr


def test_an_option_value_may_begin_with_a_dash() -> None:
    """`secrets.token_urlsafe` makes tokens that begin with `-` one time in 64."""
    from trace_proxy.cli import build_parser
    from trace_proxy.config import values_may_start_with_dash

    argv = ["serve", "--admin-token", "-Xy_9", "--register-upstreams", "--sample-seed", "-3"]
    parsed = vars(build_parser().parse_args(values_may_start_with_dash(argv)))
    parsed.pop("command")
    settings = resolve("serve", parsed)
    assert (settings.admin_token, settings.sample_seed) == ("-Xy_9", -3)
    assert settings.register_upstreams
    # a value that is itself an option is still a missing value
    assert run_cli("serve", "--admin-token", "--register-upstreams").returncode == 2


def test_every_backend_name_has_a_factory_and_every_factory_a_name() -> None:
    from trace_proxy.exporters import BACKENDS
    from trace_proxy.exporters.options import BACKEND_NAMES

    assert sorted(BACKEND_NAMES) == sorted(BACKENDS)


def test_each_command_of_the_table_is_the_subcommand_it_runs() -> None:
    from trace_proxy.cli import COMMANDS, build_parser

    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    assert list(subparsers.choices) == list(COMMANDS)  # type: ignore[arg-type]


def test_the_command_line_imports_nothing_heavy() -> None:
    """`--help` and a typo answer at once: each command imports its work only when it runs."""
    heavy = ("aiohttp", "prometheus_client", "transformers", "tokenizers", "mlflow", "pyarrow",
             "openai", "opentelemetry", "trackio", "weave", "uvloop")  # fmt: skip
    code = (
        "import sys, trace_proxy.cli; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"


def test_the_backends_declare_their_options_without_reading_config() -> None:
    """exporters/ stands below config: config places the backends' options in its table."""
    from trace_proxy.config import OPTIONS_BY_NAME
    from trace_proxy.exporters import options as backends

    assert OPTIONS_BY_NAME["otlp_endpoint"].help == backends.OTLP_ENDPOINT.help
    code = "import sys, trace_proxy.exporters; print('trace_proxy.config' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "False"
