"""Shared fixtures: the built wheel, the venv it is installed in, megatron-core folders.

The environments come from ``tools/envs.py`` (``make test`` builds them first). The wheel
is built once per run, on the xdist controller, from this checkout, and installed with pip
into ``.cache/e2e-venv`` beside torch 2.13.0: end-to-end tests then run real saves in
subprocesses of that venv, with one megatron-core release on ``PYTHONPATH``. Those
subprocesses never import mcore_autopatch themselves; only the installed ``.pth`` does.
"""

import json
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import envs  # noqa: E402

JOB = os.path.join(ROOT, "examples", "checkpoint_job.py")
WHEEL_ENV = "MCORE_AUTOPATCH_TEST_WHEEL"
VENV_ENV = "MCORE_AUTOPATCH_TEST_VENV"
AFFECTED = ["0.9.0", "0.10.0", "0.11.0", "0.12.0", "0.12.1", "0.12.2", "0.12.3"]
FIXED_SAVING = ["0.13.0", "0.13.1"]
FIXED_IMPORT_ONLY = ["0.14.0", "0.15.3", "0.16.1"]
REFERENCE = "0.13.1"  # native serialization_format support: the byte oracle


COMPAT_RESULTS = os.path.join(envs.CACHE, "compat-results.json")
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
    py = install_wheel(envs.clone_venv(envs.E2E, os.path.join(run_dir, "venv")), wheel)
    os.environ[WHEEL_ENV] = wheel  # inherited by xdist workers
    os.environ[VENV_ENV] = py
    config._mcore_autopatch_run_dir = run_dir


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
# A test marked ``@pytest.mark.compat(version, "what it verifies")`` contributes a cell to
# README's compatibility table (tools/compat_table.py renders it from the last full run).


def compat_params(versions: List[str], what: str) -> List[Any]:
    """``versions`` as parameters, each marked as verifying ``what`` for that release."""
    return [pytest.param(v, marks=pytest.mark.compat(v, what), id=v) for v in versions]


def pytest_runtest_setup(item: Any) -> None:
    for mark in item.iter_markers("compat"):
        item.user_properties.append(("compat", list(mark.args)))


def pytest_runtest_logreport(report: Any) -> None:
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    for name, value in getattr(report, "user_properties", ()):
        if name == "compat":
            version, what = value
            _compat.setdefault(version, {}).setdefault(what, []).append(report.outcome)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if _is_worker(session.config) or not _compat:
        return
    summary = {
        version: {
            what: "passed" if all(o == "passed" for o in outcomes) else "failed" for what, outcomes in rows.items()
        }
        for version, rows in _compat.items()
    }
    with open(COMPAT_RESULTS, "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)


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


@pytest.fixture
def private_venv(wheel_path: str, tmp_path: Any) -> str:
    """A venv of its own (torch and the wheel installed) for tests that change the venv."""
    return install_wheel(envs.clone_venv(envs.E2E, str(tmp_path / "venv")), wheel_path)


@pytest.fixture(scope="session")
def e2e_site_packages(e2e_python: str) -> str:
    return envs.site_packages(e2e_python)


def mcore_folder(version: str) -> str:
    folder = envs.mcore_folder(version)
    if not os.path.isdir(folder):
        pytest.skip("megatron-core %s folder missing: run `python3 tools/envs.py mcore`" % version)
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
def run_job(e2e_python: str, tmp_path: Any):
    """Run examples/checkpoint_job.py with one megatron-core release; return its JSON result."""

    def run(
        version: str,
        *args: str,
        env: Optional[Dict[str, str]] = None,
        timeout: float = 240,
        folder: Optional[str] = None,
    ) -> Dict[str, Any]:
        environment = clean_env(PYTHONPATH=mcore_folder(version), **(env or {}))
        target = folder or str(tmp_path / ("ckpt-%s-%d" % (version, len(os.listdir(tmp_path)))))
        proc = run_python(e2e_python, [JOB, "--json", "--dir", target, *args], environment, timeout=timeout)
        result = last_json(proc)
        result["stderr"] = proc.stderr
        result["returncode"] = proc.returncode
        return result

    return run


@pytest.fixture(scope="session")
def reference_digests(e2e_python: str, tmp_path_factory: Any) -> Any:
    """``.distcp`` digests native megatron-core 0.13.1 writes, per (state, thread count)."""
    cache: Dict[Any, Dict[str, str]] = {}

    def get(state: str = "basic", thread_count: Optional[int] = None) -> Dict[str, str]:
        key = (state, thread_count)
        if key not in cache:
            folder = str(tmp_path_factory.mktemp("reference"))
            args = [JOB, "--json", "--no-load", "--dir", folder, "--state", state]
            if thread_count is not None:
                args += ["--thread-count", str(thread_count)]
            # MCORE_AUTOPATCH=0: the oracle is megatron-core's own writer, untouched.
            proc = run_python(e2e_python, args, clean_env(PYTHONPATH=mcore_folder(REFERENCE), MCORE_AUTOPATCH="0"))
            result = last_json(proc)
            assert result["ok"], result
            cache[key] = result["files"]
        return cache[key]

    return get
