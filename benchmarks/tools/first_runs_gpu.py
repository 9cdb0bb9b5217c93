"""Does capturing a graph variant without its eager first run pay off? Within one process, at
the ``long`` scenario's shape (Llama-3-8B shapes, batch 16, 8,192-token prompts, 512 new
tokens), each policy's decode is timed alternately with the eager first runs (each decode
its own :func:`~kvcompose.hf.static.decode_signature`, as if nothing of its layout had run
before) and without them (the signature of the earlier decodes, whose variants ran).

    python benchmarks/tools/first_runs_gpu.py --policies fullkv,thinkv --repeats 2 \
        --out benchmarks/results/first_runs_gpu.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_e2e_gpu import SCENARIOS, build_model, make_policy, prompts  # noqa: E402
from harness.results import ResultLog  # noqa: E402
from harness.table import format_table  # noqa: E402
from kvcompose.hf import static  # noqa: E402
from kvcompose.speed import time_policy  # noqa: E402

FIELDS = ("ms_per_step", "steady_ms_per_step", "warm_ups", "one_time_s", "capture_host_s", "host_ms_per_replay")


def timed(model, policy, ids, mask, new: int, eager_first_runs: bool, warm_up: bool) -> dict:
    signature = static.decode_signature
    if eager_first_runs:
        static.decode_signature = lambda cache, fused: object()  # matches no earlier decode
    try:
        row = time_policy(model, policy, ids, mask, new, warm_up=warm_up)
    finally:
        static.decode_signature = signature
    return {k: row.get(k) for k in FIELDS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="fullkv,thinkv")
    ap.add_argument("--repeats", type=int, default=2, help="timed pairs per policy")
    ap.add_argument("--smoke", action="store_true", help="tiny model and lengths (checks the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="history file the run is added to")
    args = ap.parse_args(argv)
    shape = dict(SCENARIOS["long"], **({"prompt": 24, "new": 12, "budget": 16} if args.smoke else {}))
    log = ResultLog(args.out) if args.out else None
    model = build_model(args.smoke, args.device)
    ids, mask = prompts(model, shape["batch"], shape["prompt"])
    records = []
    for name in [p for p in args.policies.split(",") if p]:
        policy = make_policy(name, shape["budget"], args.smoke)
        for repeat in range(args.repeats):
            for eager in (False, True):  # the first decode warms up at the timed capacity, registering its variants
                row = timed(model, policy, ids, mask, shape["new"], eager, warm_up=repeat == 0 and not eager)
                records.append(dict(policy=name, repeat=repeat, eager_first_runs=eager, **row))
                print(records[-1], flush=True)
                if log:
                    log.save({"smoke": args.smoke, "shape": shape, "records": records})
    cols = ["policy", "repeat", "eager_first_runs", *FIELDS]
    print(format_table(cols, [[f"{r[c]:.3g}" if isinstance(r[c], float) else r[c] for c in cols] for r in records]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
