"""Shared fixtures: the built wheel, the venvs it is installed in, megatron-core folders.

The environments come from ``tools/envs.py`` (``make test`` builds them first). The wheel
is built once per run, on the xdist controller, from this checkout, and installed with pip
into this run's hard-link clones of the cached venvs: ``.cache/e2e-venv`` (torch 2.13.0,
the CPU wheel) and one venv per real torch release of ``envs.TORCH_MATRIX`` (CUDA builds
from the registry). End-to-end tests then run real saves in subprocesses of those venvs,
with one megatron-core release on ``PYTHONPATH``. Those subprocesses never import
mcore_autopatch themselves; only the installed ``.pth`` does.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import envs  # noqa: E402

JOB = os.path.join(ROOT, "examples", "checkpoint_job.py")
# Runs the job unchanged, then reports `mcore-autopatch status` of that same process.
JOB_THEN_STATUS = os.path.join(ROOT, "tests", "import_scripts", "job_then_status.py")
STATUS_PREFIX = "MCORE_AUTOPATCH_STATUS "
WHEEL_ENV = "MCORE_AUTOPATCH_TEST_WHEEL"
VENV_ENV = "MCORE_AUTOPATCH_TEST_VENV"
TORCH_VENVS_ENV = "MCORE_AUTOPATCH_TEST_TORCH_VENVS"  # JSON: {torch release: venv python}
SEED_VENV_ENV = "MCORE_AUTOPATCH_TEST_SEED_VENV"
RUN_DIR_ENV = "MCORE_AUTOPATCH_TEST_RUN_DIR"
TORCH_SELECTION_ENV = "MCORE_AUTOPATCH_TEST_TORCH"
CPU_TORCH = "2.13.0"  # the e2e venv's torch (the CPU wheel on this machine's disk)
# Every torch release the end-to-end matrix runs on, oldest first.
TORCH_RELEASES = sorted([*envs.TORCH_MATRIX, CPU_TORCH], key=lambda r: tuple(int(p) for p in r.split(".")))
# Every release that makes the old call (0.6-0.11: four arguments; 0.12: transforms first).
AFFECTED = ["0.6.0", "0.7.0", "0.8.0", "0.9.0", "0.10.0", "0.11.0", "0.12.0", "0.12.1", "0.12.2", "0.12.3"]
# The plain round trips run every release on torch 2.13.0 (the CPU wheel), and these on every
# real CUDA torch: the oldest (synchronous saves only) and the four-argument writer of 0.9.
# The 0.12 call shape runs on every torch through the job path (0.12.1,
# tests/test_e2e_job_path.py; 0.12.0 and 0.12.2 ship its checkpointing modules,
# tests/test_e2e_source_trees.py), as does 0.11.0 where it matters; 0.8.0 runs the selftest
# on 2.9.0 and 2.11.0.
AFFECTED_ON_EVERY_TORCH = ["0.6.0", "0.9.0"]
# ... on these torches: 2.9.0 and 2.15.0 run both releases through the job path
# (tests/test_e2e_fresh_stack.py), and 2.11.0 has 2.9.0's _write_item.
PLAIN_TORCHES = ["2.6.0", "2.7.1", "2.8.0", "2.13.0"]
FIXED_SAVING = ["0.13.0", "0.13.1"]
FIXED_IMPORT_ONLY = ["0.14.0", "0.15.3", "0.16.1"]
REFERENCE = envs.REFERENCE_MEGATRON  # native serialization_format support: the byte oracle


# --- the two tiers ---------------------------------------------------------------------
# `make test` (the everyday tier, MCORE_AUTOPATCH_TEST_TIER=everyday) runs every test that is
# not marked ``matrix``, on torch 2.13.0 (the CPU wheel on this disk) and its numpy 2 venv;
# `make test-matrix` runs the rest: every other torch, numpy 1.26 fresh venvs, CPython 3.12,
# the seed stack with Ray, the other CPythons, and the release sweeps. A test is in the matrix
# when it is marked so, when its ``torch_release`` is another venv, or when it needs one of
# the matrix's interpreters (docs/testing.md says which tier proves which cell).
TIER_ENV = "MCORE_AUTOPATCH_TEST_TIER"
EVERYDAY = "everyday"
MATRIX_FIXTURES = {"other_python", "seed_python", "torchless_python"}


def everyday_venv_keys() -> "set[str]":
    return {CPU_TORCH, fresh_key(CPU_TORCH, "numpy2")}


def in_matrix(item: Any) -> bool:
    if item.get_closest_marker("matrix") is not None:
        return True
    # A module's MATRIX_CELLS: its tests (by name) or parametrized cells (name[id]) that the
    # everyday tier leaves to the matrix (more releases or variants of what it proves once).
    cells = getattr(getattr(item, "module", None), "MATRIX_CELLS", ())
    if item.name in cells or getattr(item, "originalname", None) in cells:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    torch = params.get("torch_release")
    if torch is not None and torch not in everyday_venv_keys():
        return True
    return not MATRIX_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)  # before -m selects: the mark must be there by then
def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    for item in items:
        if in_matrix(item):
            item.add_marker(pytest.mark.matrix)


def missing_environment(what: str) -> None:
    """Skip a test whose environment is not built; in the everyday tier, where every test's
    environment is built by `make test`, that is a misfiled test: fail and say so."""
    if os.environ.get(TIER_ENV) == EVERYDAY:
        pytest.fail("%s, which `make test` does not build: mark the test `matrix` (tests/conftest.py)" % what)
    pytest.skip(what)


COMPAT_RESULTS = os.path.join(envs.CACHE, "compat-results.json")
COMPAT_ENVIRONMENTS = os.path.join(envs.CACHE, "compat-environments.json")
_compat: Dict[str, Dict[str, List[str]]] = {}


def _is_worker(config: Any) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: Any) -> None:
    """Build the wheel and install it into this run's own clone of the e2e venv."""
    if _is_worker(config) or os.environ.get(WHEEL_ENV):
        return
    if not os.path.exists(envs.venv_python(envs.TOOLS)) or not os.path.exists(envs.venv_python(envs.E2E)):
        return  # environments missing: e2e tests skip with a hint
    run_dir = os.path.join(envs.CACHE, "runs", str(os.getpid()))
    wheel = envs.wheel(run_dir)
    # This run's clones of every cached venv, each with the wheel installed by pip.
    sources = {CPU_TORCH: envs.E2E}
    sources.update({r: envs.torch_venv_folder(r) for r in selected_torch_releases() if envs.torch_ready(r)})
    if envs.seed_ready() and envs.SEED_TORCH in selected_torch_releases():
        sources["seed"] = envs.SEED
    # What a fresh image has (numpy 2 or 1.26, setuptools >= 82): "2.9.0-numpy2" and so on.
    for release in envs.FRESH_TORCH:
        for line in envs.NUMPY_LINES:
            if envs.fresh_ready(release, line) and (release == CPU_TORCH or release in selected_torch_releases()):
                sources[fresh_key(release, line)] = envs.fresh_folder(release, line)
    if envs.py312_ready() and envs.PY312_TORCH in selected_torch_releases():
        sources[PY312] = envs.PY312
    if os.environ.get(TIER_ENV) == EVERYDAY:  # only what its tests use, even where more is built
        sources = {key: folder for key, folder in sources.items() if key in everyday_venv_keys()}

    def clone_with_wheel(name: str) -> str:
        return install_wheel(envs.clone_venv(sources[name], os.path.join(run_dir, "venv-" + name)), wheel)

    with ThreadPoolExecutor(2) as pool:
        pythons = dict(zip(sources, pool.map(clone_with_wheel, sources)))
    os.environ[WHEEL_ENV] = wheel  # inherited by xdist workers
    os.environ[VENV_ENV] = pythons.pop(CPU_TORCH)
    os.environ[SEED_VENV_ENV] = pythons.pop("seed", "")
    os.environ[TORCH_VENVS_ENV] = json.dumps(pythons)
    os.environ[RUN_DIR_ENV] = run_dir
    config._mcore_autopatch_run_dir = run_dir


PY312 = "py312"  # CPython 3.12 with torch 2.9.0 and numpy 2 (envs.py312)


def fresh_key(release: str, numpy_line: str) -> str:
    """The name of a fresh venv among this run's venvs: "2.9.0-numpy2"."""
    return "%s-%s" % (release, numpy_line)


def selected_torch_releases() -> List[str]:
    """The real torch releases this run covers: all of envs.TORCH_MATRIX, or those named in
    ``MCORE_AUTOPATCH_TEST_TORCH`` (naming none of them: 2.13.0 only)."""
    chosen = os.environ.get(TORCH_SELECTION_ENV)
    if chosen is None:
        return list(envs.TORCH_MATRIX)
    return [r for r in envs.TORCH_MATRIX if r in chosen.replace(",", " ").split()]


def pytest_unconfigure(config: Any) -> None:
    run_dir = getattr(config, "_mcore_autopatch_run_dir", None)
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


def install_wheel(python: str, wheel: str) -> str:
    """``pip install`` the wheel into the venv of ``python``, as a user would."""
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel], check=True, capture_output=True
    )
    return python


# --- the compatibility table -----------------------------------------------------------
# A test marked ``@pytest.mark.compat(version, "what it verifies")`` contributes to the cell
# (megatron-core ``version``, torch release) of README's compatibility table; the torch
# release is the test's ``torch_release`` parameter, or 2.13.0 (the e2e venv) without one.
# tools/compat_table.py renders the table from the last full run.


def compat_params(versions: List[str], what: str, writer: str = "megatron-core") -> List[Any]:
    """``versions`` as parameters, each marked as verifying ``what`` for that release (of
    ``writer``: its rows are labelled "name version" unless it is megatron-core)."""
    label = "%s" if writer == "megatron-core" else writer + " %s"
    return [pytest.param(v, marks=pytest.mark.compat(label % v, what), id=v) for v in versions]


def torch_params(releases: Optional[List[str]] = None) -> List[Any]:
    return [pytest.param(r, id="torch" + r) for r in (releases or TORCH_RELEASES)]


def matrix_params(everywhere: List[str], cpu_only: List[str], what: str) -> List[Any]:
    """(version, torch_release) pairs: ``everywhere`` on PLAIN_TORCHES, ``cpu_only`` on 2.13.0,
    each marked as a cell of the compatibility table verifying ``what``."""
    pairs = [(v, t) for t in PLAIN_TORCHES for v in everywhere] + [(v, CPU_TORCH) for v in cpu_only]
    pairs.sort(key=lambda pair: (TORCH_RELEASES.index(pair[1]), tuple(int(p) for p in pair[0].split("."))))
    return [pytest.param(v, t, marks=pytest.mark.compat(v, what), id="%s-torch%s" % (v, t)) for v, t in pairs]


def pytest_runtest_setup(item: Any) -> None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    for mark in item.iter_markers("compat"):
        version, what = mark.args
        item.user_properties.append(("compat", [version, params.get("torch_release", CPU_TORCH), what]))


def pytest_runtest_logreport(report: Any) -> None:
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    for name, value in getattr(report, "user_properties", ()):
        if name == "compat":
            version, torch, what = value
            _compat.setdefault(version, {}).setdefault(torch, {}).setdefault(what, []).append(report.outcome)


def _verdict(outcomes: List[str]) -> str:
    if "failed" in outcomes:
        return "failed"
    return "passed" if all(o == "passed" for o in outcomes) else "skipped"


def cached_venvs_with_the_package() -> List[str]:
    """Cached venvs (never installed into: they are the images *without* mcore-autopatch) that
    have it all the same, e.g. from a ``pip`` script of a clone, whose first line names the
    cached venv's python."""
    folders = [
        envs.E2E,
        envs.SEED,
        envs.PY312,
        *glob.glob(os.path.join(envs.TORCH_VENVS, "*")),
        *glob.glob(os.path.join(envs.FRESH, "*")),
    ]
    return [
        folder
        for folder in folders
        if glob.glob(os.path.join(folder, "lib", "python3*", "site-packages", "mcore_autopatch*"))
    ]


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if not _is_worker(session.config):
        polluted = cached_venvs_with_the_package()
        if polluted:
            sys.stderr.write("\nERROR: a test installed mcore-autopatch into cached venvs: %s\n" % polluted)
            session.exitstatus = 1
    option = session.config.option
    # Only a tier's whole run (``make test``, ``make test-matrix``: no -k, no files or test ids
    # named) rewrites its results.
    named = getattr(session.config, "args_source", None) == pytest.Config.ArgsSource.ARGS
    if _is_worker(session.config) or not _compat or option.keyword or named or TIER_ENV not in os.environ:
        return
    if TORCH_SELECTION_ENV in os.environ:
        return
    summary = {
        version: {torch: {what: _verdict(o) for what, o in checks.items()} for torch, checks in by_torch.items()}
        for version, by_torch in _compat.items()
    }
    with open(tier_file(COMPAT_RESULTS), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    keys = {key for by_key in summary.values() for key in by_key}
    with open(tier_file(COMPAT_ENVIRONMENTS), "w") as f:
        json.dump({key: envs.described(venv_folder(key)) for key in sorted(keys)}, f, indent=1, sort_keys=True)


def tier_file(path: str) -> str:
    """``compat-results.json`` -> ``compat-results-everyday.json``: each tier keeps its own;
    tools/compat_table.py reads them together."""
    stem, ext = os.path.splitext(path)
    return "%s-%s%s" % (stem, os.environ[TIER_ENV], ext)


def venv_folder(key: str) -> str:
    """The cached venv behind a venv key of the compatibility table ("2.9.0", "2.9.0-numpy2", "py312")."""
    if key == CPU_TORCH:
        return envs.E2E
    if key == PY312:
        return envs.PY312
    torch, _, line = key.partition("-")
    return envs.fresh_folder(torch, line) if line else envs.torch_venv_folder(torch)


@pytest.fixture(scope="session")
def wheel_path() -> str:
    path = os.environ.get(WHEEL_ENV)
    if not path or not os.path.exists(path):
        pytest.skip("test environments missing: run `make test` (or `python3 tools/envs.py`)")
    return path


@pytest.fixture(scope="session")
def e2e_python(wheel_path: str) -> str:
    """This run's venv python: torch 2.13.0 and the wheel installed by pip."""
    return os.environ[VENV_ENV]


@pytest.fixture(scope="session")
def torch_python(wheel_path: str) -> Callable[[str], str]:
    """``torch_python(release)``: this run's venv python with real torch ``release`` and the
    wheel installed by pip (2.13.0: the e2e venv)."""
    venvs = json.loads(os.environ.get(TORCH_VENVS_ENV) or "{}")
    venvs[CPU_TORCH] = os.environ[VENV_ENV]

    def get(release: str) -> str:
        if release not in venvs:
            if release.split("-")[0] not in [*selected_torch_releases(), CPU_TORCH] and release != PY312:
                chosen = os.environ[TORCH_SELECTION_ENV]
                pytest.skip("torch %s not selected for this run (%s=%r)" % (release, TORCH_SELECTION_ENV, chosen))
            missing_environment("venv %s missing: run `make test-matrix-env` (python3 tools/envs.py)" % release)
        return str(venvs[release])

    return get


@pytest.fixture(scope="session")
def python_without_wheel(wheel_path: str) -> Callable[[str], str]:
    """``python_without_wheel(release)``: the cached venv of torch ``release`` itself, which
    never has the wheel (this run installs it into clones): an image without mcore-autopatch."""

    def get(release: str) -> str:
        if release == CPU_TORCH:
            return envs.venv_python(envs.E2E)
        if release == PY312:
            if not envs.py312_ready() or envs.PY312_TORCH not in selected_torch_releases():
                missing_environment("the CPython 3.12 venv is not part of this run")
            return envs.venv_python(envs.PY312)
        torch, _, line = release.partition("-")
        if line:
            if not envs.fresh_ready(torch, line) or (torch != CPU_TORCH and torch not in selected_torch_releases()):
                missing_environment("fresh venv %s not part of this run" % release)
            return envs.venv_python(envs.fresh_folder(torch, line))
        if release not in selected_torch_releases() or not envs.torch_ready(release):
            missing_environment("torch %s venv not part of this run" % release)
        return envs.venv_python(envs.torch_venv_folder(release))

    return get


@pytest.fixture
def private_venv(wheel_path: str, tmp_path: Any) -> str:
    """A venv of its own (torch and the wheel installed) for tests that change the venv."""
    return install_wheel(envs.clone_venv(envs.E2E, str(tmp_path / "venv")), wheel_path)


@pytest.fixture(scope="session")
def e2e_site_packages(e2e_python: str) -> str:
    return envs.site_packages(e2e_python)


def checkout_for_make(work: "os.PathLike[str] | str") -> str:
    """A copy of the checkout with what `make wheel` needs; its .cache/tools is this run's."""
    work = str(work)
    envs.copy_sources(work)
    os.mkdir(os.path.join(work, "tools"))
    shutil.copy2(os.path.join(ROOT, "Makefile"), work)
    shutil.copy2(os.path.join(ROOT, "tools", "envs.py"), os.path.join(work, "tools"))
    os.mkdir(os.path.join(work, ".cache"))
    os.symlink(envs.TOOLS, os.path.join(work, ".cache", "tools"))
    return work


def mcore_folder(version: str) -> str:
    folder = envs.mcore_folder(version)
    if not os.path.isdir(folder):
        missing_environment("megatron-core %s folder missing: run `python3 tools/envs.py mcore`" % version)
    return folder


def clean_env(**extra: Optional[str]) -> Dict[str, str]:
    """The environment of this process without anything that would steer the child."""
    return envs.child_env(**extra)


def run_python(
    python: str, args: List[str], env: Dict[str, str], timeout: float = 240, cwd: Optional[str] = None
) -> subprocess.CompletedProcess:
    # Never from the checkout by default: with no .pth processed, `python -m mcore_autopatch`
    # run from the repository root would import the source tree instead of the wheel.
    cwd = cwd or _neutral_cwd()
    return subprocess.run([python, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _neutral_cwd() -> str:
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), "mcore-autopatch-tests-cwd")
    os.makedirs(folder, exist_ok=True)
    return folder


def last_json(proc: subprocess.CompletedProcess) -> Dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, "no JSON result (rc=%s)\nstdout:\n%s\nstderr:\n%s" % (
        proc.returncode,
        proc.stdout,
        proc.stderr[-4000:],
    )
    return json.loads(lines[-1])


@pytest.fixture
def run_job(torch_python: Callable[[str], str], tmp_path: Any):
    """Run examples/checkpoint_job.py with one megatron-core release; return its JSON result.

    ``torch`` picks the venv (default: torch 2.13.0); ``tree`` puts another megatron folder
    than release ``version``'s on PYTHONPATH. With ``status=True`` the job runs
    through ``tests/import_scripts/job_then_status.py``, which adds ``result["status"]``:
    ``mcore-autopatch status`` of the very process that saved, taken after the job ended.
    """

    def run(
        version: str,
        *args: str,
        env: Optional[Dict[str, str]] = None,
        timeout: float = 240,
        folder: Optional[str] = None,
        torch: str = CPU_TORCH,
        status: bool = False,
        tree: Optional[str] = None,
    ) -> Dict[str, Any]:
        python = torch_python(torch)
        environment = clean_env(PYTHONPATH=tree or mcore_folder(version), **(env or {}))
        target = folder or str(tmp_path / ("ckpt-%s-%d" % (version, len(os.listdir(tmp_path)))))
        script = [JOB_THEN_STATUS, JOB] if status else [JOB]
        proc = run_python(python, [*script, "--json", "--dir", target, *args], environment, timeout=timeout)
        result = last_json(proc)
        if status:
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(STATUS_PREFIX)]
            assert lines, "no status after the job\nstdout:\n%s\nstderr:\n%s" % (proc.stdout, proc.stderr[-4000:])
            result["status"] = json.loads(lines[-1][len(STATUS_PREFIX) :])
        result["stderr"] = proc.stderr
        result["returncode"] = proc.returncode
        return result

    return run


@pytest.fixture(scope="session")
def reference_digests(torch_python: Callable[[str], str]) -> Any:
    """``.distcp`` digests native megatron-core 0.13.1 writes, per (state, thread count, torch).

    Shared by the xdist workers of a run through a file per key in the run folder, written
    under a lock, so each oracle save runs once per run.
    """
    cache: Dict[Any, Dict[str, str]] = {}

    def get(state: str = "basic", thread_count: Optional[int] = None, torch: str = CPU_TORCH) -> Dict[str, str]:
        key = (state, thread_count, torch)
        if key not in cache:
            cache[key] = _shared_reference(torch_python(torch), *key)
        return cache[key]

    return get


def shared_once(name: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per test run, whichever xdist worker asks first; its JSON result is
    kept in the run folder under ``name`` (the other worker waits on the same lock)."""
    import fcntl

    path = os.path.join(os.environ[RUN_DIR_ENV], "shared-%s.json" % name)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        value = compute()
        with open(path + ".tmp", "w") as f:
            json.dump(value, f)
        os.replace(path + ".tmp", path)
        return value


def run_dir_folder(prefix: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir=os.environ[RUN_DIR_ENV])


def _shared_reference(python: str, state: str, thread_count: Optional[int], torch: str) -> Any:
    def save() -> Any:
        folder = run_dir_folder("reference-")
        args = [JOB, "--json", "--no-load", "--dir", folder, "--state", state]
        if thread_count is not None:
            args += ["--thread-count", str(thread_count)]
        # MCORE_AUTOPATCH=0: the oracle is megatron-core's own writer, untouched.
        proc = run_python(python, args, clean_env(PYTHONPATH=mcore_folder(REFERENCE), MCORE_AUTOPATCH="0"))
        result = last_json(proc)
        assert result["ok"], result
        assert result["write_item_replaced"] is False
        return result["files"]

    return shared_once("reference-%s-%s-torch%s" % (state, thread_count, torch), save)


# --- a training job's checkpoint path (tests/job_path/training_job.py) ----------------------

TRAINING_JOB = os.path.join(ROOT, "tests", "job_path", "training_job.py")


def run_training_job(
    python: str,
    version: str,
    phase: str,
    root: str,
    *args: str,
    ranks: int = 2,
    env: Optional[Dict[str, str]] = None,
    timeout: float = 600,
    path: Optional[str] = None,
) -> Dict[str, Any]:
    """Run the job's ``phase`` (save / resume) with ``ranks`` gloo ranks; its merged JSON.

    On a machine without CUDA the job redirects megatron-core's few CUDA calls to the CPU
    (tests/job_path/cpu_stand_in_for_cuda.py); on a GPU machine that switch does nothing.
    """
    environment = clean_env(PYTHONPATH=path or mcore_folder(version), CPU_STAND_IN_FOR_CUDA="1", **(env or {}))
    # A rank that fails leaves the others waiting in a collective: a minute, not gloo's 30.
    command = [TRAINING_JOB, "--launch", str(ranks), phase, "--root", root, "--json", "--pg-timeout", "120", *args]
    proc = run_python(python, command, environment, timeout=timeout)
    result = last_json(proc)
    result["stderr"] = proc.stderr
    return result


def job_failure(result: Dict[str, Any]) -> str:
    """What to print when a job that should have worked did not."""
    ranks = result.get("ranks") or []
    tracebacks = [r.get("traceback") or "" for r in ranks]
    return "%s\n%s\nstderr:\n%s" % (
        result.get("error"),
        "\n".join(tracebacks)[-6000:],
        result.get("stderr", "")[-3000:],
    )
