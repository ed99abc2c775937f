"""`trace-proxy demo` and `trace-proxy show` as a new user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from proxy_helpers import events, trajectories


def test_demo_writes_the_store_and_show_reads_it(tmp_path: Path) -> None:
    output = tmp_path / "traces"
    demo = subprocess.run(
        [sys.executable, "-m", "trace_proxy", "demo", "--output", str(output)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    assert "Recorded 16 trajectories" in demo.stdout
    assert f"trace-proxy show {output}" in demo.stdout

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
