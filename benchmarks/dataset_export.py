"""How fast `trace-proxy export` writes a big store as Parquet, and the memory it takes.

Builds the store `benchmarks/viewer.py` builds (copies of the demo's trajectories with new ids,
keys and rewards: one big step of `--step-size`, `--steps` more of `--other-size`), then runs
`trace-proxy export` as a user does, once per form, each in a process of its own, and reports
wall time, CPU time, peak RSS (`wait4`), rows and bytes written, and rows per second.

    python benchmarks/dataset_export.py                  # the run recorded in RESULTS.md
    python benchmarks/dataset_export.py --from traces --step-size 10000 --steps 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from viewer import templates, write_store


def export(store: Path, out: Path, form: str) -> dict[str, float]:
    began = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "trace_proxy", "export", str(store), "--form", form,
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    output = (child.stdout.read() if child.stdout else b"").decode()
    errors = (child.stderr.read() if child.stderr else b"").decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"export failed: {errors}")
    rows = int(output.split()[1])  # "wrote N <form> rows in ..."
    written = sum(p.stat().st_size for p in out.glob("*.parquet"))
    return {
        "rows": rows,
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "written_mb": written / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", help="a store to copy trajectories from")
    parser.add_argument("--step-size", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=5, help="steps after the big one")
    parser.add_argument("--other-size", type=int, default=1_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        source = Path(args.source) if args.source else root / "demo"
        if not args.source:
            subprocess.run([sys.executable, "-m", "trace_proxy", "demo", "--output", str(source)],
                           check=True, capture_output=True)  # fmt: skip
        store = root / "store"
        count = write_store(store, templates(source), args)
        size = sum(p.stat().st_size for p in store.rglob("*.jsonl")) / 1e6
        biggest = (store / "bench" / "viewer" / "step-000001.jsonl").stat().st_size / 1e6
        print(f"store: {count} trajectories, {size:.0f} MB (largest step {args.step_size} "
              f"trajectories, {biggest:.0f} MB)")  # fmt: skip
        print("| form | rows | wall s | CPU s | rows/s (wall) | peak RSS MB | Parquet MB |")
        print("|---|---|---|---|---|---|---|")
        for form in ("sft", "rl"):
            r = export(store, root / form, form)
            print(f"| {form} | {r['rows']:.0f} | {r['wall']:.1f} | {r['cpu']:.1f} | "
                  f"{r['rows'] / r['wall']:.0f} | {r['peak_rss_mb']:.0f} | "
                  f"{r['written_mb']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
