"""Import overhead: what our finder adds to a torch job's imports.

* ``import torch`` then megatron-core 0.12.1's writer module (from PYTHONPATH): whole-process
  CPU time in the venv with the wheel (hook and fix active), the same venv with
  ``MCORE_AUTOPATCH=0`` (only the .pth runs), and the venv without the wheel; rotating.
* ``find_spec`` of our finder rejecting a name it does not watch, in ns per call, next to an
  empty Python method (the floor) and ``_distutils_hack``'s finder; timeit, in-process.
* How many lookups reach ``sys.meta_path`` during those imports, so that the reject cost can
  be multiplied out.

    python3 bench/import_cost.py [--quick]
"""

import sys
from typing import Dict, List

from _common import (
    AFFECTED,
    INPROCESS,
    WRITER,
    BenchEnvs,
    Row,
    alternate,
    mcore_env,
    median,
    paired_ratio,
    run_child,
    spread,
    standalone,
)

IMPORT_BUDGET_RATIO = 1.01
REJECT_BUDGET_NS = 200.0

CODE = (
    "import json, sys, time, warnings; warnings.simplefilter('ignore'); t = time.perf_counter(); "
    "import torch; import %s as w; "
    "print(json.dumps({'s': time.perf_counter() - t, "
    "'fixed': bool(getattr(w._write_item, '__mcore_autopatch__', False))}))" % WRITER
)


def torch_import(e: BenchEnvs, rounds: int) -> List[Row]:
    configs = {
        "with wheel": (e.with_py, mcore_env(AFFECTED), True),
        "with wheel, MCORE_AUTOPATCH=0": (e.with_py, mcore_env(AFFECTED, MCORE_AUTOPATCH="0"), False),
        "without wheel": (e.without_py, mcore_env(AFFECTED), False),
    }

    def runner(py: str, env: Dict[str, str], fixed: bool):
        def go() -> Dict[str, float]:
            child = run_child([py, "-c", CODE], env)
            result = child.json()
            if result["fixed"] is not fixed:
                raise RuntimeError("%s: writer fixed = %s, expected %s" % (py, result["fixed"], fixed))
            return {"cpu": child.cpu_s, "import": result["s"]}

        return go

    runs = alternate({k: runner(*v) for k, v in configs.items()}, rounds, label="import torch + writer")
    cpu = {k: [r["cpu"] for r in v] for k, v in runs.items()}
    wall = {k: [r["import"] for r in v] for k, v in runs.items()}
    base = "without wheel"
    ratio = paired_ratio(cpu["with wheel"], cpu[base])
    off = "with wheel, MCORE_AUTOPATCH=0"
    return [
        Row(
            "import torch + writer (0.12.1), CPU",
            "x%.3f (%.2f s vs %.2f s)" % (ratio, median(cpu["with wheel"]), median(cpu[base])),
            "<= x%.2f" % IMPORT_BUDGET_RATIO,
            ratio <= IMPORT_BUDGET_RATIO,
            "whole-process user+sys of `python -c 'import torch; import <writer>'`, venv with wheel "
            "(fix applied) vs without, %d runs each rotating; median of per-round ratios (without: %s)"
            % (rounds, spread(cpu[base])),
            samples=runs,
            import_cpu_s=median(cpu[base]),
        ),
        Row(
            "import torch + writer, wall of the imports",
            "x%.3f with wheel, x%.3f with MCORE_AUTOPATCH=0"
            % (paired_ratio(wall["with wheel"], wall[base]), paired_ratio(wall[off], wall[base])),
            how="perf_counter around the two import statements, same runs, vs the venv without the wheel",
        ),
        Row(
            "import torch + writer, MCORE_AUTOPATCH=0, CPU",
            "x%.3f" % paired_ratio(cpu[off], cpu[base]),
            how="same runs: the .pth runs, no finder; vs the venv without the wheel",
        ),
    ]


def reject(e: BenchEnvs, rounds: int, number: int) -> List[Row]:
    result = run_child([e.with_py, INPROCESS, "reject", str(rounds), str(number)], mcore_env(AFFECTED)).json()
    ns = result["median_ns"]
    ours, floor = ns["ours"], ns["empty method"]
    rows = [
        Row(
            "finder: find_spec rejecting a name",
            "%.0f ns (floor %.0f ns, +%.0f ns)" % (ours, floor, ours - floor),
            "<= %.0f ns" % REJECT_BUDGET_NS,
            ours <= REJECT_BUDGET_NS,
            "timeit of `finder.find_spec('json.decoder', json.__path__, None)` in the venv with the wheel, "
            "%d rounds x %d calls alternating with an empty method of the same signature (the floor); "
            "median per call" % (rounds, number),
            samples=result["ns"],
            reject_ns=ours,
        )
    ]
    if "_distutils_hack" in ns:
        rows.append(
            Row(
                "finder: _distutils_hack's find_spec, same name",
                "%.0f ns" % ns["_distutils_hack"],
                how="same rounds, setuptools' DistutilsMetaFinder, for scale",
            )
        )
    return rows


def lookups(e: BenchEnvs, reject_ns: float) -> List[Row]:
    calls = run_child([e.with_py, INPROCESS, "count-imports"], mcore_env(AFFECTED)).json()["find_spec_calls"]
    return [
        Row(
            "finder: lookups during import torch + writer",
            "%d calls, ~%.0f µs in our reject path" % (calls, calls * reject_ns / 1e3),
            how="a counting finder put ahead of ours; calls x the median reject time above",
            calls=calls,
            reject_total_ms=calls * reject_ns / 1e6,
        )
    ]


def run(e: BenchEnvs, quick: bool) -> List[Row]:
    rows = reject(e, 7 if quick else 15, 200_000 if quick else 1_000_000)
    rows += lookups(e, rows[0].data["reject_ns"])
    return torch_import(e, 3 if quick else 9) + rows


if __name__ == "__main__":
    sys.exit(standalone(run))
