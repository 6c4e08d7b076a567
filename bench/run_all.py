"""Run every benchmark, print the table, write bench/results.md (what `make bench` runs).

    python3 bench/run_all.py                 # everything, about 5-10 minutes
    python3 bench/run_all.py --quick         # fewer repeats, for development
    python3 bench/run_all.py --only startup fix
    python3 bench/run_all.py --only faults   # how soon a failed async save raises everywhere
    python3 bench/run_all.py --strict        # exit 1 when a budget is missed

Builds the wheel from this checkout, clones ``.cache/e2e-venv`` twice under a temporary
folder in ``.cache/`` (one clone gets the wheel through pip, one does not) and removes them
at the end. Benchmarks print figures; they are not tests, and CI does not run them.
"""

import argparse
import os
import signal
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fault_latency
import fix_cost
import import_cost
import save_cost
import startup_cost
from _common import (
    AFFECTED,
    BENCH,
    NATIVE,
    BenchEnvs,
    Row,
    error_row,
    load_average,
    log,
    machine,
    markdown,
    print_table,
)

BENCHMARKS: Dict[str, Callable[[BenchEnvs, bool], List[Row]]] = {
    "startup": startup_cost.run,
    "import": import_cost.run,
    "fix": fix_cost.run,
    "save": save_cost.run,
    "faults": fault_latency.run,
}


def modelled(rows: List[Row]) -> List[Row]:
    """The import overhead computed from its parts, where the benchmarks that measure them ran."""
    found = {k: r.data[k] for r in rows for k in ("import_cpu_s", "reject_total_ms", "fix_ms") if k in r.data}
    if len(found) < 3:
        return []
    extra_ms = found["reject_total_ms"] + found["fix_ms"]
    ratio = 1 + extra_ms / 1e3 / found["import_cpu_s"]
    return [
        Row(
            "import torch + writer, from its parts",
            "x%.4f (+%.2f ms of %.2f s)" % (ratio, extra_ms, found["import_cpu_s"]),
            "<= x%.2f" % import_cost.IMPORT_BUDGET_RATIO,
            ratio <= import_cost.IMPORT_BUDGET_RATIO,
            "(lookups x reject time + time to fix) / CPU time of the imports without the wheel: the overhead "
            "the whole-process ratio above cannot resolve through the noise",
        )
    ]


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (for development)")
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these benchmarks")
    p.add_argument("--strict", action="store_true", help="exit 1 when a budget is missed")
    p.add_argument("--out", default=os.path.join(BENCH, "results.md"), help="markdown file to write ('' for none)")
    p.add_argument("--note", action="append", default=[], help="a line to add under the markdown table")
    p.add_argument("--keep", action="store_true", help="keep the temporary venvs (their path is logged)")
    args = p.parse_args(argv)
    # A plain `kill` must still remove the temporary venvs (BenchEnvs.__exit__).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started, load_before = time.time(), load_average()
    rows: List[Row] = []
    with BenchEnvs(keep=args.keep) as e:
        for name in args.only or list(BENCHMARKS):
            log("running %s" % name)
            t0 = time.time()
            try:
                rows += BENCHMARKS[name](e, args.quick)
            except Exception as exc:  # one broken benchmark must not hide the others' figures
                rows.append(error_row(name, exc))
            log("%s done in %.0f s" % (name, time.time() - t0))
        versions = e.versions

    rows += modelled(rows)
    print()
    print_table(rows)
    missed = [r for r in rows if r.ok is False]
    print("\n%d budget(s) checked, %d missed" % (sum(r.ok is not None for r in rows), len(missed)))
    if args.out:
        info = machine()
        info.update(
            {
                "python": versions.get("python", "?"),
                "torch": versions.get("torch", "?"),
                "megatron-core": "%s (with the fix), %s (native)" % (AFFECTED, NATIVE),
                "load average (1/5/15 min), before / after": "%s / %s" % (load_before, load_average()),
                "run": "%s, %.0f s" % ("--quick" if args.quick else "full", time.time() - started),
            }
        )
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(markdown(rows, info, args.note))
        log("wrote %s" % os.path.relpath(args.out))
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
