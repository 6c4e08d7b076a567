"""The project's own commands keep stdout for results: progress, timings and warnings go to stderr.

`make wheel` (tests/test_packaging.py) and the CLI (tests/test_cli.py) are checked where they
are built; here: tools/envs.py's and bench's loggers, an unknown envs.py target, and
`make demo` for real in a copy of the checkout, whose stdout is its one verdict line.
"""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, checkout_for_make, clean_env, envs

DEMO_VERDICT = "demo ok: the save failed without mcore-autopatch and succeeded with it installed\n"


def test_envs_log_goes_to_stderr_only(capsys):
    envs.log("building something")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "[envs] building something\n"


def test_bench_log_goes_to_stderr_only(capsys):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import _common
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    _common.log("measuring")
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "[bench] measuring\n")


def test_envs_stops_before_pip_when_the_disk_is_short_and_says_how_much(monkeypatch, capsys):
    usage = shutil.disk_usage(envs.ROOT)
    monkeypatch.setattr(envs.shutil, "disk_usage", lambda path: usage._replace(free=3 * 10**9))
    with pytest.raises(SystemExit) as stopped:
        envs.ensure_free_space(envs.TORCH_INSTALL_PEAK_GB, "installing torch 2.8.0")
    message = str(stopped.value)
    assert "installing torch 2.8.0 needs about 8 GB free" in message and "3.0 GB is free" in message
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(envs.shutil, "disk_usage", lambda path: usage._replace(free=9 * 10**9))
    envs.ensure_free_space(envs.TORCH_INSTALL_PEAK_GB, "installing torch 2.8.0")  # enough: no stop


def test_envs_unknown_target_says_why_on_stderr_and_changes_nothing(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "envs.py"), "no-such-target"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=str(tmp_path),
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("unknown target(s): no-such-target; choose from ")
    assert os.listdir(str(tmp_path)) == []


def checkout_for_demo(work: str) -> str:
    """What `make demo` reads of the checkout; .cache/tools is this run's (it builds the wheel)."""
    checkout_for_make(work)
    os.mkdir(os.path.join(work, "examples"))
    shutil.copy2(os.path.join(ROOT, "tools", "demo.py"), os.path.join(work, "tools"))
    shutil.copy2(os.path.join(ROOT, "examples", "checkpoint_job.py"), os.path.join(work, "examples"))
    return work


@pytest.mark.e2e
def test_make_demo_fails_without_the_fix_then_saves_and_prints_only_its_verdict(wheel_path, tmp_path):
    """The README's first command, in a copy of the checkout: its .venv gets torch 2.13.0 and
    megatron-core 0.12.1 as a fresh install does, the job fails, the wheel goes in, the job
    saves and loads back. What happened is told on stderr."""
    work = checkout_for_demo(str(tmp_path / "checkout"))
    proc = subprocess.run(["make", "demo"], cwd=work, capture_output=True, text=True, timeout=900, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    assert proc.stdout == DEMO_VERDICT
    before, after = proc.stderr.split("== pip install ")
    assert (
        "checkpoint save FAILED: RuntimeError: Worker failure: _write_item() missing 1 required positional " in before
    )
    assert "checkpoint saved and loaded back equal" in after
    assert "fix applied:   yes" in after


# `make demo` installs torch into its own .venv (1 GB, 90 s): in the matrix.
MATRIX_CELLS = {"test_make_demo_fails_without_the_fix_then_saves_and_prints_only_its_verdict"}
