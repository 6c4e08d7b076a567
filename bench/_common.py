"""What the benchmarks share: their two venvs, timing of child processes, statistics, the table.

Every comparison is run side by side in one process tree: A and B alternate (ABBAAB...), and
the figure quoted is a ratio or difference of medians, because these machines are noisy.
Standard library only; runs under any Python 3.8+ (``make bench`` uses the system python3).
"""

import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import envs  # noqa: E402

JOB = os.path.join(ROOT, "examples", "checkpoint_job.py")
INPROCESS = os.path.join(BENCH, "inprocess.py")
WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
AFFECTED = "0.12.1"  # the release a job would run with the fix
NATIVE = "0.13.1"  # passes serialization_format itself: the speed to match


# --- the environments ------------------------------------------------------------------


class BenchEnvs:
    """The wheel built from this checkout, and two hard-link clones of ``.cache/e2e-venv``
    under a temporary folder: ``with_py`` has the wheel installed by pip, ``without_py``
    has nothing of ours. Removed again on exit."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self.tmp = ""
        self.with_py = ""
        self.without_py = ""
        self.wheel = ""
        self.with_dir = ""
        self.without_dir = ""
        self.versions: Dict[str, str] = {}

    def __enter__(self) -> "BenchEnvs":
        missing = [p for p in (envs.venv_python(envs.E2E), envs.venv_python(envs.TOOLS)) if not os.path.exists(p)]
        missing += [f for f in map(envs.mcore_folder, (AFFECTED, NATIVE)) if not os.path.isdir(f)]
        if missing:
            raise SystemExit("bench: missing %s; run `make test-env` first" % ", ".join(missing))
        # Under .cache (not /tmp): hard links need the same file system as the e2e venv.
        os.makedirs(envs.CACHE, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix="bench-", dir=envs.CACHE)
        try:
            log("building the wheel and two venv clones under %s" % os.path.relpath(self.tmp, ROOT))
            self.wheel = envs.wheel(os.path.join(self.tmp, "dist"))
            self.with_dir = os.path.join(self.tmp, "with-wheel")
            self.without_dir = os.path.join(self.tmp, "without-wheel")
            self.with_py = envs.clone_venv(envs.E2E, self.with_dir)
            subprocess.run(
                [self.with_py, "-m", "pip", "install", "-q", "--disable-pip-version-check", self.wheel],
                check=True,
                capture_output=True,
            )
            self.without_py = envs.clone_venv(envs.E2E, self.without_dir)
            self._check()
        except BaseException:
            self.__exit__()
            raise
        return self

    def clone_with_wheel(self, release: str) -> Optional[str]:
        """A clone of a cached venv with the wheel: torch ``release``'s ("2.9.0"), or a fresh
        one ("2.9.0-numpy2"); None when it is not built."""
        torch, _, line = release.partition("-")
        ready = envs.fresh_ready(torch, line) if line else envs.torch_ready(release)
        if not ready:
            return None
        folder = envs.fresh_folder(torch, line) if line else envs.torch_venv_folder(release)
        python = envs.clone_venv(folder, os.path.join(self.tmp, "torch-%s" % release))
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", self.wheel],
            check=True,
            capture_output=True,
        )
        return python

    def _check(self) -> None:
        """Fail early unless exactly one of the two venvs has our finder at startup."""
        probe = "import sys; print(any(getattr(type(f), '_mcore_autopatch_finder', 0) for f in sys.meta_path))"
        for py, expected in ((self.with_py, "True"), (self.without_py, "False")):
            out = subprocess.run([py, "-c", probe], env=clean_env(), capture_output=True, text=True, check=True)
            if out.stdout.strip() != expected:
                raise SystemExit("bench: %s: finder installed = %s, expected %s" % (py, out.stdout.strip(), expected))
        code = (
            "import json, platform, importlib.metadata as m; "
            "print(json.dumps({'python': platform.python_version(), 'torch': m.version('torch')}))"
        )
        out = subprocess.run([self.with_py, "-c", code], env=clean_env(), capture_output=True, text=True, check=True)
        self.versions = json.loads(out.stdout)

    def __exit__(self, *exc: object) -> None:
        if self.tmp and not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def scratch(self, name: str) -> str:
        """A folder of its own under the temporary folder (same disk as the venvs)."""
        path = os.path.join(self.tmp, name)
        os.makedirs(path, exist_ok=True)
        return path


def clean_env(**extra: Optional[str]) -> Dict[str, str]:
    """This process's environment without anything that would steer a child Python."""
    return envs.child_env(**extra)


def mcore_env(version: str, **extra: Optional[str]) -> Dict[str, str]:
    return clean_env(PYTHONPATH=envs.mcore_folder(version), **extra)


# --- running and timing children ---------------------------------------------------------


class Child:
    """One finished child process: its CPU time (user + system, all threads), wall time, output."""

    def __init__(self, cpu_s: float, wall_s: float, stdout: str, stderr: str, returncode: int) -> None:
        self.cpu_s = cpu_s
        self.wall_s = wall_s
        self.stdout = stdout
        self.stderr = stderr
        self.returncode = returncode

    def json(self) -> Dict[str, Any]:
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith("{")]
        if self.returncode != 0 or not lines:
            raise RuntimeError("child failed (rc=%s): %s" % (self.returncode, (self.stderr or self.stdout)[-3000:]))
        return json.loads(lines[-1])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(argv: Sequence[str], env: Dict[str, str], capture: bool = True, timeout: float = 600) -> Child:
    """Run ``argv`` to the end. CPU time is the RUSAGE_CHILDREN delta (microsecond
    resolution), valid because this process runs one child at a time."""
    pipe = subprocess.PIPE if capture else subprocess.DEVNULL
    cpu0, wall0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(list(argv), env=env, stdout=pipe, stderr=pipe, timeout=timeout)
    wall, cpu = time.perf_counter() - wall0, _children_cpu() - cpu0
    decode = (lambda b: b.decode("utf-8", "replace")) if capture else (lambda b: "")
    return Child(cpu, wall, decode(proc.stdout or b""), decode(proc.stderr or b""), proc.returncode)


def alternate(
    variants: Dict[str, Callable[[], Any]], rounds: int, label: str = "", warmup: int = 1
) -> Dict[str, List[Any]]:
    """Call each variant once per round, the order reversed every other round (AB BA AB ...),
    after ``warmup`` untimed rounds; return each variant's results in call order."""
    names = list(variants)
    results: Dict[str, List[Any]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            value = variants[name]()
            if r >= warmup:
                results[name].append(value)
        if label and rounds >= 10 and (r - warmup + 1) % max(1, rounds // 4) == 0 and r >= warmup:
            log("%s: round %d/%d" % (label, r - warmup + 1, rounds))
    return results


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of a[i] / b[i]: each pair ran back to back (same round of ``alternate``), so
    the load of the moment divides out better than in a ratio of medians."""
    return median([x / y for x, y in zip(a, b)])


def paired_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of a[i] - b[i], pairs as in ``paired_ratio``."""
    return median([x - y for x, y in zip(a, b)])


def spread(values: Sequence[float]) -> str:
    """Interquartile range as ``q1..q3`` relative to the median, for the 'how' column."""
    if len(values) < 4:
        return "n=%d" % len(values)
    q = statistics.quantiles(values, n=4)
    m = median(values)
    return "n=%d, IQR %+.1f%%..%+.1f%%" % (len(values), 100 * (q[0] / m - 1), 100 * (q[2] / m - 1)) if m else ""


# --- results -------------------------------------------------------------------------------


class Row:
    """One line of the table. ``ok`` is None for figures without a budget."""

    def __init__(
        self, measure: str, value: str, budget: str = "", ok: Optional[bool] = None, how: str = "", **data: Any
    ) -> None:
        self.measure = measure
        self.value = value
        self.budget = budget
        self.ok = ok
        self.how = how
        self.data = data

    @property
    def verdict(self) -> str:
        return "" if self.ok is None else ("PASS" if self.ok else "FAIL")


def error_row(name: str, exc: BaseException) -> Row:
    return Row(name, "error", "", False, "%s: %s" % (type(exc).__name__, str(exc)[:300]))


def print_table(rows: Sequence[Row], out: Any = None) -> None:
    out = out or sys.stdout
    headers = ("measure", "value", "budget", "result")
    cells = [(r.measure, r.value, r.budget, r.verdict) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  how measured"
    print(line, file=out)
    print("-" * min(len(line) + 40, 160), file=out)
    for row, c in zip(rows, cells):
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)) + "  " + row.how, file=out)


def machine() -> Dict[str, str]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip() or str(os.cpu_count())
    return {
        "nproc": nproc,
        "cpu": model,
        "kernel": platform.release(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def load_average() -> str:
    try:
        return "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "?"


def markdown(rows: Sequence[Row], info: Dict[str, str], notes: Sequence[str]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "# mcore-autopatch: what the hook costs",
        "",
        "Produced by `make bench` (`bench/run_all.py`); every comparison ran side by side, A and B",
        "alternating, and is quoted as a median (of per-round ratios or differences where two are compared).",
        "",
        "| machine | |",
        "|---|---|",
    ]
    lines += ["| %s | %s |" % (cell(k), cell(v)) for k, v in info.items()]
    lines += ["", "| measure | value | budget | result | how measured |", "|---|---|---|---|---|"]
    lines += [
        "| %s | %s | %s | %s | %s |" % tuple(cell(x) for x in (r.measure, r.value, r.budget, r.verdict, r.how))
        for r in rows
    ]
    if notes:
        lines += [""] + ["- %s" % cell(n) for n in notes]
    return "\n".join(lines) + "\n"


def log(message: str) -> None:
    print("[bench] %s" % message, file=sys.stderr, flush=True)


def standalone(run: Callable[[BenchEnvs, bool], List[Row]], argv: Optional[Sequence[str]] = None) -> int:
    """``main`` of one benchmark script run on its own: ``--quick`` for fewer repeats."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer repeats (for development)")
    args = p.parse_args(argv)
    with BenchEnvs() as e:
        rows = run(e, args.quick)
    print_table(rows)
    return 0
