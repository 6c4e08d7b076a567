"""Time to fix: what the hook adds to the import of megatron-core's writer module.

In a process of the venv with the wheel where ``MCORE_AUTOPATCH=0`` kept the finder off,
torch and megatron-core 0.12.1's checkpointing are imported; then the watched modules are
executed once more without our finder (twice before and twice after) and once with it (our
submodules not yet imported, as in a real job). The difference is the time to fix: our first imports, the spec lookup
behind our finder, the loader wrapper, the policy (metadata lookup, signature read) and the
rebinding. A second kind of process does the same work step by step, each step cold, for
the breakdown (under ``-X importtime``, for the self time of each of our modules). The two
kinds alternate; medians.

    python3 bench/fix_cost.py [--quick]
"""

import re
import sys
from typing import Dict, List

from _common import AFFECTED, INPROCESS, BenchEnvs, Row, alternate, mcore_env, median, run_child, spread, standalone

# The budget is a share of what the watched imports themselves cost in the same process
# (megatron-core's checkpointing modules imported cold, torch already imported): the time to
# fix may be at most 0.5 % of it (issue 27; about 9 ms for 0.12.1 at ~1.9 s on 2 cores).
FIX_BUDGET_SHARE = 0.005
SELF_TIME = re.compile(r"^import time:\s+(\d+) \|\s+\d+ \|\s*(mcore_autopatch\.\S+)\s*$")


def breakdown_run(py: str, env: Dict[str, str]) -> Dict[str, object]:
    child = run_child([py, "-X", "importtime", INPROCESS, "fix-breakdown"], env)
    result = child.json()
    result["self_us"] = {m.group(2): int(m.group(1)) for m in map(SELF_TIME.match, child.stderr.splitlines()) if m}
    return result


def run(e: BenchEnvs, quick: bool) -> List[Row]:
    env = mcore_env(AFFECTED, MCORE_AUTOPATCH="0")
    runs = alternate(
        {
            "total": lambda: run_child([e.with_py, INPROCESS, "fix-total"], env).json(),
            "breakdown": lambda: breakdown_run(e.with_py, env),
        },
        3 if quick else 9,
        label="time to fix",
        warmup=0,
    )
    extra = [r["hooked_ms"] - r["plain_ms"] for r in runs["total"]]
    total = median(extra)
    share = median([(r["hooked_ms"] - r["plain_ms"]) / r["cold_import_ms"] for r in runs["total"]])
    cold_ms = median([r["cold_import_ms"] for r in runs["total"]])
    rows_2_9 = _all_fixes_applied(e, quick)
    steps = {name: median([r["ms"][name] for r in runs["breakdown"]]) for name in runs["breakdown"][0]["ms"]}
    modules = sorted({m for r in runs["breakdown"] for m in r["self_us"]})
    self_us = {m: median([r["self_us"].get(m, 0) for r in runs["breakdown"]]) for m in modules}
    stdlib = sorted(
        {m for r in runs["total"] for m in r["new_modules"] if not m.startswith("mcore_autopatch")}
        | {m for r in runs["breakdown"] for ms in r["new_modules"].values() for m in ms if not m.startswith("mcore_")}
    )
    cold = [k for k in steps if not k.endswith("warm")]
    rows = [
        Row(
            "time to fix (writer + strategies import, hook vs none, torch %s)" % e.versions.get("torch", "?"),
            "%.2f ms = %.3f %% of the watched imports (%.0f ms cold)" % (total, share * 100, cold_ms),
            "<= %.1f %%" % (FIX_BUDGET_SHARE * 100),
            share <= FIX_BUDGET_SHARE,
            "in-process: the watched modules executed without our finder twice, with it once (our modules cold, "
            "torch and megatron warm), without it twice more, each from a collected heap; the hooked run minus "
            "the median plain run, median over processes (%s); plain exec %.2f ms; "
            "modules newly imported besides ours: %s"
            % (spread(extra), median([r["plain_ms"] for r in runs["total"]]), ", ".join(stdlib) or "none"),
            samples=runs,
            fix_ms=total,
        )
    ]
    for name in cold:
        how = "median, each step cold in a fresh process"
        if name == "import our modules" and self_us:
            how += "; -X importtime self µs: " + ", ".join("%s %.0f" % (m, self_us[m]) for m in modules)
        rows.append(Row("  fix breakdown: %s" % name, "%.3f ms" % steps[name], how=how))
    rows.append(
        Row(
            "  fix breakdown: sum of the cold steps",
            "%.2f ms" % sum(steps[k] for k in cold),
            how="vs %.2f ms total, which also holds the spec lookup behind our finder and the loader wrapper "
            "(the steps here are timed one by one, in other processes)" % total,
        )
    )
    warm = [k for k in steps if k.endswith("warm")]
    rows += [Row("  fix breakdown: %s" % k, "%.3f ms" % steps[k], how="everything imported already") for k in warm]
    return rows[:1] + rows_2_9 + rows[1:]


# Where the most fixes apply: megatron-core 0.12.1 on torch 2.9.0 with numpy 2 (write_item,
# keep_mcore_data, load_without_mcore_data, numpy_removed_names), and 0.8.0 in torch 2.9.0's own
# venv (setuptools with pkg_resources, so that 0.8 imports while the finder is off: write_item,
# keep_mcore_data, load_without_mcore_data, torch_load_weights_only, sharded_objects_planned_once,
# and the pkg_resources window around its bodies).
MOST_FIXES = (("2.9.0-numpy2", AFFECTED), ("2.9.0", "0.8.0"))


def _all_fixes_applied(e: BenchEnvs, quick: bool) -> List[Row]:
    """The same where the most fixes are needed and applied."""
    rows = []
    for venv, version in MOST_FIXES:
        label = "time to fix, megatron-core %s, %s" % (version, venv)
        python = e.clone_with_wheel(venv)
        if python is None:
            rows.append(Row(label, "not measured", how="venv %s not built (make test-env)" % venv))
            continue
        env = mcore_env(version, MCORE_AUTOPATCH="0")
        runs = [run_child([python, INPROCESS, "fix-total"], env).json() for _ in range(3 if quick else 9)]
        extra = [r["hooked_ms"] - r["plain_ms"] for r in runs]
        share = median([(r["hooked_ms"] - r["plain_ms"]) / r["cold_import_ms"] for r in runs])
        cold_ms = median([r["cold_import_ms"] for r in runs])
        applied = sorted(name for name, d in runs[-1]["decisions"].items() if d and d["applied"])
        rows.append(
            Row(
                "%s (fixes applied: %s)" % (label, ", ".join(applied)),
                "%.2f ms = %.3f %% of the watched imports (%.0f ms cold)" % (median(extra), share * 100, cold_ms),
                "<= %.1f %%" % (FIX_BUDGET_SHARE * 100),
                share <= FIX_BUDGET_SHARE,
                "as above, in a clone of that venv with the wheel, %d watched modules (%s); median of %d "
                "processes (%s)"
                % (len(runs[-1]["watched"]), ", ".join(runs[-1]["watched"]), len(extra), spread(extra)),
                samples={"total": runs},
            )
        )
    return rows


if __name__ == "__main__":
    sys.exit(standalone(run))
