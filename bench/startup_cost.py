"""Startup: what ``mcore_autopatch.pth`` costs every interpreter of an image.

* ``python -X importtime -c pass`` in the venv with the wheel: cumulative microseconds of
  our modules, next to ``_distutils_hack`` (setuptools' ``distutils-precedence.pth``) in the
  same runs, and to an empty package imported by a ``.pth`` of its own (the floor).
* ``python -c pass`` CPU time (user + system) in the venv with the wheel vs the venv
  without it, alternating, many runs; the floor venv beside them.

The floor venv is a clone of the venv without the wheel plus ``mcore_bench_empty.pth``
(``import mcore_bench_empty``) and an empty ``mcore_bench_empty/__init__.py``: what any
``.pth`` that imports a package costs, before that package does anything. Its name sorts
after ``distutils-precedence.pth``, as ours does, so both find the path caches warm.

    python3 bench/startup_cost.py [--quick]
"""

import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

from _common import (
    BenchEnvs,
    Row,
    alternate,
    clean_env,
    envs,
    median,
    paired_diff,
    paired_ratio,
    run_child,
    spread,
    standalone,
)

IMPORTTIME_BUDGET_US = 150.0
PASS_BUDGET_RATIO = 1.02
OURS = "mcore_autopatch"
FLOOR = "mcore_bench_empty"
LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)\s*$")


def top_level_cumulative(stderr: str, prefix: str) -> Optional[int]:
    """Sum of the cumulative µs of modules named ``prefix`` or ``prefix.*`` that were not
    imported by another such module (so nothing is counted twice); None if none was seen."""
    entries = []
    for line in stderr.splitlines():
        m = LINE.match(line)
        if m:
            entries.append((len(m.group(3)), m.group(4), int(m.group(2))))
    # -X importtime prints a module after everything it imported, indented one level
    # deeper; read backwards, each module's importers are on the stack.
    total, seen, stack = 0, False, []  # stack of (depth, is_ours)
    for depth, name, cumulative in reversed(entries):
        while stack and stack[-1][0] >= depth:
            stack.pop()
        ours = name == prefix or name.startswith(prefix + ".")
        if ours and not any(o for _, o in stack):
            total += cumulative
            seen = True
        stack.append((depth, ours))
    return total if seen else None


def floor_venv(e: BenchEnvs) -> str:
    """The venv without the wheel, plus a .pth importing an empty package."""
    folder = os.path.join(e.tmp, "floor-venv")
    py = envs.clone_venv(e.without_dir, folder)
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    if not site.startswith(folder):
        raise RuntimeError("floor venv site-packages %s is outside %s" % (site, folder))
    os.makedirs(os.path.join(site, FLOOR))
    open(os.path.join(site, FLOOR, "__init__.py"), "w").close()
    with open(os.path.join(site, FLOOR + ".pth"), "w") as f:
        f.write("import %s\n" % FLOOR)
    # Byte-compile it once, as pip does for ours.
    subprocess.run([py, "-c", "import sys; assert %r in sys.modules" % FLOOR], env=clean_env(), check=True)
    return py


def importtime(e: BenchEnvs, floor_py: str, runs: int) -> List[Row]:
    env = clean_env()

    def measure(py: str, names: List[str]) -> Dict[str, int]:
        child = run_child([py, "-X", "importtime", "-c", "pass"], env)
        out = {}
        for name in names:
            value = top_level_cumulative(child.stderr, name)
            if value is None and name != "_distutils_hack":
                raise RuntimeError("%s is not imported at startup:\n%s" % (name, child.stderr[-2000:]))
            if value is not None:
                out[name] = value
        return out

    runs_ = alternate(
        {"with": lambda: measure(e.with_py, [OURS, "_distutils_hack"]), "floor": lambda: measure(floor_py, [FLOOR])},
        runs,
        label="importtime",
    )
    ours = [r[OURS] for r in runs_["with"]]
    hack = [r["_distutils_hack"] for r in runs_["with"] if "_distutils_hack" in r]
    floor = [r[FLOOR] for r in runs_["floor"]]
    value = median(ours)
    rows = [
        Row(
            "startup: import of our modules (.pth)",
            "%.0f µs" % value,
            "<= %.0f µs" % IMPORTTIME_BUDGET_US,
            value <= IMPORTTIME_BUDGET_US,
            "`python -X importtime -c pass` with the wheel, cumulative µs of mcore_autopatch, median (%s)"
            % spread(ours),
            samples=ours,
        ),
        Row(
            "startup: an empty package by .pth (floor)",
            "%.0f µs" % median(floor),
            how="same, for an empty package imported by its own .pth, runs alternating with the above (%s)"
            % spread(floor),
            samples=floor,
        ),
    ]
    if hack:
        rows.append(
            Row(
                "startup: _distutils_hack, same runs",
                "%.0f µs" % median(hack),
                how="setuptools' distutils-precedence.pth in the venv with the wheel; it runs first and "
                "so also pays for the first look into site-packages (%s)" % spread(hack),
                samples=hack,
            )
        )
    return rows


def pass_cpu(e: BenchEnvs, floor_py: str, rounds: int) -> List[Row]:
    env = clean_env()

    def cpu_us(py: str):
        return lambda: run_child([py, "-c", "pass"], env, capture=False).cpu_s * 1e6

    us = alternate(
        {"with": cpu_us(e.with_py), "without": cpu_us(e.without_py), "floor": cpu_us(floor_py)},
        rounds,
        label="python -c pass",
        warmup=5,
    )
    ratio = paired_ratio(us["with"], us["without"])
    floor_ratio = paired_ratio(us["floor"], us["without"])
    return [
        Row(
            "startup: `python -c pass` CPU time",
            "x%.3f (%+.0f µs of %.0f µs)" % (ratio, paired_diff(us["with"], us["without"]), median(us["without"])),
            "<= x%.2f" % PASS_BUDGET_RATIO,
            ratio <= PASS_BUDGET_RATIO,
            "user+sys of each child (getrusage RUSAGE_CHILDREN), venv with wheel vs without, %d runs each "
            "alternating; median of per-round ratios (without: %s)" % (rounds, spread(us["without"])),
            samples=us,
        ),
        Row(
            "startup: `python -c pass`, empty package by .pth",
            "x%.3f (%+.0f µs)" % (floor_ratio, paired_diff(us["floor"], us["without"])),
            how="same runs: the floor venv (a .pth importing an empty package) vs the venv without the wheel",
        ),
    ]


def run(e: BenchEnvs, quick: bool) -> List[Row]:
    floor_py = floor_venv(e)
    try:
        return importtime(e, floor_py, 15 if quick else 31) + pass_cpu(e, floor_py, 60 if quick else 400)
    finally:
        shutil.rmtree(os.path.dirname(os.path.dirname(floor_py)), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(standalone(run))
