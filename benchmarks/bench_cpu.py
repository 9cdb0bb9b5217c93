"""`kvcompose bench` on the CPU, appended to the history in ``results/cpu_bench_smollm2.json``.

The command itself writes one run to a file of its own (``--json``); this script runs it with
the record's settings and adds that run, labelled, to the history, so a record is never
assembled by hand:

    python benchmarks/bench_cpu.py --run cpu2 --presets fullkv,nvfp4,kivi2,kivi4,thinkv,thinkv-int,fp8

Anything after ``--`` goes to ``kvcompose bench`` unchanged (``--batch``, ``--prompt``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.results import append_run, result_path  # noqa: E402

from kvcompose.cli import main as kvcompose  # noqa: E402

DEFAULT_PRESETS = "fullkv,nvfp4,kivi2,kivi4,thinkv,thinkv-int,fp8"
RECORD_SETTINGS = ["--batch", "16", "--prompt", "512", "--new-tokens", "256"]  # arguments after -- override them


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="label of this run in the history")
    ap.add_argument("--presets", default=DEFAULT_PRESETS)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: comparable across machines)")
    ap.add_argument("--out", default=str(result_path("cpu_bench_smollm2")))
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory() as tmp:
        one_run = Path(tmp) / "bench.json"
        code = kvcompose(["bench", "--threads", str(args.threads), "--presets", args.presets, *RECORD_SETTINGS,
                          "--json", str(one_run), *extra])
        if code:
            return code
        run = json.loads(one_run.read_text())
    environment = run.pop("environment")
    print(f"appended run {args.run!r} to {append_run(args.out, {'run': args.run, **run}, environment)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
