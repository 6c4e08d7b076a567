"""The command line, run as a user runs it: subprocesses of venvs with the wheel from pip.

`python -m mcore_autopatch` and the `mcore-autopatch` console script, against real torch
2.13.0 and real megatron-core releases on PYTHONPATH: `status` (text and `--json`),
`check` (exit 0 active or not needed, 1 needed but not active, 2 cannot tell), `selftest`
(a real async save and load) and `--version`, in the interpreters where the startup hook
runs and in those where it cannot (MCORE_AUTOPATCH=0, `python -S`, `pip install --target`,
a zipapp), where the advice given must be one that works.
"""

import json
import os
import re
import subprocess
from typing import Dict, List, Optional

import envs
import pytest
from conftest import clean_env, mcore_folder, run_python

pytestmark = pytest.mark.e2e

PTH = "mcore_autopatch.pth"
DOCKERFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "Dockerfile")
STATUS_KEYS = {
    "version": str,
    "enabled": bool,
    "hook_installed": bool,
    "torch": str,
    "megatron_core": str,
    "needed": bool,
    "applied": bool,
    "reason": str,
}
# The advice status/check give, followed literally, then check run in the same interpreter.
THEN_CHECK = "from mcore_autopatch.cli import main; sys.exit(main(['check']))"
INSTALL_THEN_CHECK = "import mcore_autopatch, sys; mcore_autopatch.install(); " + THEN_CHECK
ADDSITEDIR_THEN_CHECK = "import site, sys; site.addsitedir(%r); " + THEN_CHECK
SERIALIZATION_FORMAT_ERROR = "_write_item() missing 1 required positional argument: 'serialization_format'"


def cli(
    python: str,
    args: List[str],
    version: Optional[str] = None,
    flags: Optional[List[str]] = None,
    path: Optional[List[str]] = None,
    **env: Optional[str],
) -> subprocess.CompletedProcess:
    """``python [flags] -m mcore_autopatch args`` with ``path`` then megatron-core ``version`` on PYTHONPATH."""
    folders = list(path or []) + ([mcore_folder(version)] if version else [])
    environment = clean_env(PYTHONPATH=os.pathsep.join(folders) if folders else None, **env)
    return run_python(python, [*(flags or []), "-m", "mcore_autopatch", *args], environment)


def rows(stdout: str) -> Dict[str, str]:
    """``status`` text as ``{label: value}``; the first line as ``"title"``."""
    lines = stdout.splitlines()
    parsed = {"title": lines[0]}
    for line in lines[1:]:
        label, _, value = line.strip().partition(": ")
        parsed[label] = value.strip()
    return parsed


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, "expected one line on stdout:\n%s\nstderr:\n%s" % (proc.stdout, proc.stderr[-3000:])
    return lines[0]


def our_log_lines(stderr: str) -> List[str]:
    return [line for line in stderr.splitlines() if line.startswith("mcore_autopatch[")]


def wheel_version(wheel_path: str) -> str:
    return os.path.basename(wheel_path).split("-")[1]


def site_packages(python: str) -> str:
    return envs.site_packages(python)


@pytest.fixture(autouse=True)
def neutral_cwd(tmp_path_factory, monkeypatch) -> None:
    """Run every subprocess from an empty folder: `python -m` puts the working directory first
    on sys.path, and from the checkout that would import the source tree instead of the wheel."""
    folder = tmp_path_factory.getbasetemp() / "cwd"
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(folder)


@pytest.fixture(scope="module")
def torchless_python(wheel_path: str, tmp_path_factory) -> str:
    """A CPython 3.12 venv with the wheel (pip --no-deps) and no torch."""
    source = envs.python_venv_folder("3.12")
    if not os.path.exists(envs.venv_python(source)):
        pytest.skip("the CPython 3.12 venv is missing: run `python3 tools/envs.py pythons`")
    python = envs.clone_venv(source, str(tmp_path_factory.mktemp("torchless") / "venv"))
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", wheel_path],
        check=True,
        capture_output=True,
    )
    return python


@pytest.fixture(scope="module")
def bare_python(wheel_path: str, tmp_path_factory) -> str:
    """A clone of the e2e venv (torch 2.13.0) without the wheel in its site-packages."""
    return envs.clone_venv(envs.E2E, str(tmp_path_factory.mktemp("bare") / "venv"))


@pytest.fixture(scope="module")
def target_dir(bare_python: str, wheel_path: str, tmp_path_factory) -> str:
    """The wheel installed with ``pip install --target DIR`` (its .pth lands in DIR)."""
    folder = str(tmp_path_factory.mktemp("target") / "libs")
    subprocess.run(
        [
            bare_python,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            folder,
            wheel_path,
        ],
        check=True,
        capture_output=True,
    )
    assert os.path.isfile(os.path.join(folder, PTH))
    return folder


# --- the startup hook runs -----------------------------------------------------------------


@pytest.mark.parametrize(
    "version, missing", [("0.12.1", "serialization_format"), ("0.9.0", "transforms and serialization_format")]
)
def test_affected_release_status_and_check_report_the_fix_active(e2e_python, wheel_path, version, missing):
    """The ordinary case: the .pth ran, the writer was fixed; status says by which file, check exits 0."""
    proc = cli(e2e_python, ["status"], version)
    assert proc.returncode == 0, proc.stderr
    info = rows(proc.stdout)
    assert info["title"] == "mcore-autopatch %s" % wheel_version(wheel_path)
    assert info["mode"] == "auto (MCORE_AUTOPATCH unset)"
    assert info["startup hook"] == "installed by %s" % os.path.join(site_packages(e2e_python), PTH)
    assert info["megatron-core"].startswith(version + " ")
    assert info["fix needed"] == "yes: megatron-core %s calls _write_item without %s; torch %s requires %s" % (
        version,
        missing,
        info["torch"],
        "it" if missing == "serialization_format" else "them",
    )
    assert info["fix applied"] == "yes"
    assert "to activate" not in info
    assert our_log_lines(proc.stderr) == []  # MCORE_AUTOPATCH_LOG unset: silent

    check = cli(e2e_python, ["check"], version)
    assert check.returncode == 0, check.stderr
    assert one_line(check).startswith("ok: fix active (megatron-core %s calls _write_item without" % version)


def test_fix_switched_off_check_exits_1_and_says_how_to_enable(e2e_python):
    """MCORE_AUTOPATCH=0 on an affected stack: a job would fail, so the gate must fail."""
    check = cli(e2e_python, ["check"], "0.12.1", MCORE_AUTOPATCH="0")
    assert check.returncode == 1, check.stdout + check.stderr
    line = one_line(check)
    assert line.startswith("FAIL: fix needed but not active in this interpreter")
    assert "MCORE_AUTOPATCH=0 switches mcore-autopatch off" in line

    info = rows(cli(e2e_python, ["status"], "0.12.1", MCORE_AUTOPATCH="0").stdout)
    assert info["mode"] == "off (MCORE_AUTOPATCH=0)"
    assert info["startup hook"] == "not installed in this interpreter"
    assert info["fix needed"].startswith("yes: megatron-core 0.12.1 calls _write_item without serialization_format")
    assert info["fix applied"] == "no"
    assert "unset it" in info["to activate"]


def test_fixed_release_check_exits_0_fix_not_needed(e2e_python):
    """megatron-core 0.13.1 passes serialization_format itself: nothing applied, nothing wrong."""
    check = cli(e2e_python, ["check"], "0.13.1")
    assert check.returncode == 0, check.stderr
    line = one_line(check)
    assert line.startswith("ok: fix not needed (megatron-core 0.13.1 passes serialization_format itself); ")
    # The guard for loading checkpoints that lost mcore_data is active (0.13.1 reads it).
    assert "; megatron-core load_without_mcore_data active (megatron-core 0.13.1 needs mcore_data" in line
    info = rows(cli(e2e_python, ["status"], "0.13.1").stdout)
    assert info["fix needed"] == "no: megatron-core 0.13.1 passes serialization_format itself"
    assert info["fix applied"] == "no"


def test_megatron_missing_check_exits_0_nothing_to_fix(e2e_python):
    """An image without megatron-core (the .pth is in every interpreter): not an error."""
    check = cli(e2e_python, ["check"])
    assert check.returncode == 0, check.stderr
    assert "nothing to fix" in one_line(check)
    info = rows(cli(e2e_python, ["status"]).stdout)
    assert info["megatron-core"] == "not installed"
    assert info["fix needed"].startswith("no: megatron-core is not installed")


def test_unknown_mode_value_status_says_behaving_as_auto(e2e_python):
    """A typo in MCORE_AUTOPATCH must not silently switch the fix off; status shows the value."""
    proc = cli(e2e_python, ["status"], "0.12.1", MCORE_AUTOPATCH="maybe")
    info = rows(proc.stdout)
    assert info["mode"] == "auto (MCORE_AUTOPATCH=maybe), an unknown value: behaving as auto"
    assert info["fix applied"] == "yes"


# --- cannot tell -------------------------------------------------------------------------


def test_torch_missing_check_exits_2_and_status_says_why(torchless_python):
    """megatron-core present but torch not importable: the signature cannot be read, so 'cannot tell'."""
    check = cli(torchless_python, ["check"], "0.12.1")
    assert check.returncode == 2, check.stdout + check.stderr
    line = one_line(check)
    assert line.startswith("UNKNOWN: cannot tell whether the fix is needed")
    assert "torch is not importable in this interpreter" in line

    info = rows(cli(torchless_python, ["status"], "0.12.1").stdout)
    assert info["torch"] == "not installed"
    assert info["megatron-core"].startswith("0.12.1 ")
    assert info["fix needed"].startswith("cannot tell: torch is not importable")
    assert info["startup hook"] == "installed by %s" % os.path.join(site_packages(torchless_python), PTH)

    data = json.loads(cli(torchless_python, ["status", "--json"], "0.12.1").stdout)
    assert data["torch"] is None
    assert data["needed"] is None
    assert data["applied"] is False

    selftest = cli(torchless_python, ["selftest"], "0.12.1")
    assert selftest.returncode == 2
    assert selftest.stdout == "selftest: cannot run: ModuleNotFoundError: No module named 'torch'\n"


# --- where .pth files are not processed ------------------------------------------------------


def test_no_site_flag_check_exits_1_and_advises_install(e2e_python):
    """`python -S` skips every .pth; the advice (install()) must make check pass."""
    path = [site_packages(e2e_python)]
    check = cli(e2e_python, ["check"], "0.12.1", flags=["-S"], path=path)
    assert check.returncode == 1, check.stdout + check.stderr
    line = one_line(check)
    assert "python -S: no .pth file is processed" in line
    assert "import mcore_autopatch; mcore_autopatch.install()" in line

    info = rows(cli(e2e_python, ["status"], "0.12.1", flags=["-S"], path=path).stdout)
    assert info["startup hook"] == "not installed in this interpreter"
    assert info["startup file"].endswith("(NOT processed at startup)")
    assert "mcore_autopatch.install()" in info["to activate"]

    followed = run_python(
        e2e_python,
        ["-S", "-c", INSTALL_THEN_CHECK],
        clean_env(PYTHONPATH=os.pathsep.join([*path, mcore_folder("0.12.1")])),
    )
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert one_line(followed).startswith("ok: fix active")


def test_target_install_status_and_check_say_not_processed(bare_python, target_dir):
    """`pip install --target DIR`: the .pth lies in DIR, which Python never scans; advice: site.addsitedir."""
    check = cli(bare_python, ["check"], "0.12.1", path=[target_dir])
    assert check.returncode == 1, check.stdout + check.stderr
    line = one_line(check)
    assert "a folder Python does not scan for .pth files" in line
    assert "site.addsitedir(%r)" % target_dir in line

    info = rows(cli(bare_python, ["status"], "0.12.1", path=[target_dir]).stdout)
    assert info["startup hook"] == "not installed in this interpreter"
    assert info["startup file"] == "%s (NOT processed at startup)" % os.path.join(target_dir, PTH)
    assert "site.addsitedir(%r)" % target_dir in info["to activate"]

    followed = run_python(
        bare_python,
        ["-c", ADDSITEDIR_THEN_CHECK % target_dir],
        clean_env(PYTHONPATH=mcore_folder("0.12.1")),
    )
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert one_line(followed).startswith("ok: fix active")


def test_zipapp_check_exits_1_and_names_the_archive(bare_python, target_dir, tmp_path):
    """A zipapp: .pth files inside an archive are never processed; only install() helps."""
    app = str(tmp_path / "app.pyz")
    subprocess.run(
        [bare_python, "-m", "zipapp", target_dir, "-m", "mcore_autopatch.cli:main", "-o", app],
        check=True,
        capture_output=True,
    )
    # On PYTHONPATH (zipapp's own __main__ template drops main()'s return value, so no exit code).
    check = cli(bare_python, ["check"], "0.12.1", path=[app])
    assert check.returncode == 1, check.stdout + check.stderr
    line = one_line(check)
    assert "imported from the zip archive %s" % app in line
    assert "mcore_autopatch.install()" in line
    run_as_app = run_python(bare_python, [app, "check"], clean_env(PYTHONPATH=mcore_folder("0.12.1")))
    assert one_line(run_as_app) == line


# --- selftest ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["MCORE_AUTOPATCH=0", "python -S"])
def test_selftest_without_the_fix_reproduces_the_failure_exit_1(e2e_python, how):
    """The selftest is a real save: without the fix it must fail exactly as training jobs do."""
    if how == "python -S":
        proc = cli(e2e_python, ["selftest"], "0.12.1", flags=["-S"], path=[site_packages(e2e_python)])
    else:
        proc = cli(e2e_python, ["selftest"], "0.12.1", MCORE_AUTOPATCH="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fix needed: yes, applied: no" in proc.stderr
    assert "the save failed after" in proc.stderr
    verdict = one_line(proc)  # stdout: the verdict only
    assert verdict.startswith("selftest: FAILED: plain state: the save raised RuntimeError: Worker failure: ")
    assert SERIALIZATION_FORMAT_ERROR in verdict
    assert "; this is the failure mcore-autopatch fixes: " in verdict
    assert "passed" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("version", ["0.12.1", "0.9.0"])
def test_selftest_with_the_fix_round_trip_passes_exit_0(e2e_python, version):
    """With the hook active the same save and load round-trips equal. stdout is the verdict,
    the same on any machine; what ran and how long it took is on stderr."""
    proc = cli(e2e_python, ["selftest"], version)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == (
        "selftest: passed: plain and distributed-optimizer-style states, and two overlapping async saves, "
        "loaded back equal\n"
    )
    assert "megatron-core %s; fix needed: yes, applied: yes" % version in proc.stderr
    for state in ("plain", "distributed-optimizer-style"):
        assert re.search(r"%s state: saved in \d+\.\d\d s, loaded back equal in \d+\.\d\d s" % state, proc.stderr)
    assert "FAILED" not in proc.stdout + proc.stderr


def test_selftest_dir_option_writes_inside_the_given_folder_and_cleans_up(e2e_python, tmp_path):
    """`selftest --dir` tests the filesystem a job will checkpoint to, and leaves nothing behind."""
    proc = cli(e2e_python, ["selftest", "--dir", str(tmp_path)], "0.12.1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "to %s%smcore-autopatch-selftest-" % (tmp_path, os.sep) in proc.stderr
    assert os.listdir(tmp_path) == []


def test_selftest_gloo_cannot_start_exits_2_cannot_run(e2e_python):
    """A sandbox where gloo finds no interface is 'cannot run here', not a failed round trip."""
    proc = cli(e2e_python, ["selftest"], "0.12.1", GLOO_SOCKET_IFNAME="mcore-autopatch-none0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert one_line(proc).startswith("selftest: cannot run: gloo did not start")
    assert "GLOO_SOCKET_IFNAME=lo" in proc.stdout


# --- examples/Dockerfile ------------------------------------------------------------------


def dockerfile_gate() -> "tuple[Dict[str, str], List[str]]":
    """The Dockerfile's ARG defaults and the RUN steps that call mcore-autopatch, as sh scripts."""
    with open(DOCKERFILE) as f:
        text = f.read().replace("\\\n", " ")
    args: Dict[str, str] = {}
    runs: List[str] = []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        elif word == "RUN" and re.search(r"mcore-autopatch (check|selftest)", rest):
            runs.append(rest)
    return args, runs


def test_dockerfile_gate_passes_with_the_fix_and_fails_the_build_when_switched_off(e2e_python):
    """The Dockerfile's own RUN steps, run by sh with the venv's bin/ on PATH (no Docker engine here)."""
    args, runs = dockerfile_gate()
    assert [("mcore-autopatch check" in r, "mcore-autopatch selftest" in r) for r in runs] == [
        (True, False),
        (False, True),
    ]
    args.pop("BASE_IMAGE")
    path = os.path.dirname(e2e_python) + os.pathsep + os.environ["PATH"]
    environment = clean_env(PATH=path, PYTHONPATH=mcore_folder("0.12.1"), **args)
    for step in runs:
        proc = subprocess.run(["sh", "-c", step], env=environment, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "selftest: passed" in proc.stdout

    off = subprocess.run(
        ["sh", "-c", runs[0]], env=dict(environment, MCORE_AUTOPATCH="0"), capture_output=True, text=True, timeout=240
    )
    assert off.returncode == 1, off.stdout + off.stderr
    assert "FAIL: fix needed but not active" in off.stdout


# --- the interface itself ------------------------------------------------------------------


def test_version_flag_prints_the_wheel_version(e2e_python, wheel_path):
    proc = cli(e2e_python, ["--version"])
    assert proc.returncode == 0
    assert proc.stdout.strip() == "mcore-autopatch %s" % wheel_version(wheel_path)


def test_status_json_has_the_documented_keys_and_types(e2e_python, wheel_path):
    """`status --json` is what status() returns (all but the pid), with the documented types."""
    proc = cli(e2e_python, ["status", "--json"], "0.12.1")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key, kind in STATUS_KEYS.items():
        assert isinstance(data[key], kind), (key, data[key])
    assert data["version"] == wheel_version(wheel_path)
    assert (data["enabled"], data["hook_installed"], data["needed"], data["applied"]) == (True, True, True, True)
    assert data["megatron_core"] == "0.12.1"
    assert data["installed_by"] == os.path.join(site_packages(e2e_python), PTH)
    assert isinstance(data["pid"], int)

    api = run_python(
        e2e_python,
        [
            "-c",
            "import json, mcore_autopatch; print(json.dumps(mcore_autopatch.status(import_writer=True), default=str))",
        ],
        clean_env(PYTHONPATH=mcore_folder("0.12.1")),
    )
    assert api.returncode == 0, api.stderr
    from_api = json.loads(api.stdout)
    assert {k: v for k, v in from_api.items() if k != "pid"} == {k: v for k, v in data.items() if k != "pid"}


def test_console_script_works_like_python_m(e2e_python, wheel_path):
    """`mcore-autopatch` in the venv's bin/ (what Dockerfiles and `docker exec` call)."""
    script = os.path.join(os.path.dirname(e2e_python), "mcore-autopatch")
    assert os.access(script, os.X_OK)
    environment = clean_env(PYTHONPATH=mcore_folder("0.12.1"))
    for args in (["--version"], ["check"]):
        by_script = subprocess.run([script, *args], env=environment, capture_output=True, text=True, timeout=240)
        by_module = cli(e2e_python, args, "0.12.1")
        assert (by_script.returncode, by_script.stdout) == (by_module.returncode, by_module.stdout)
    off = subprocess.run(
        [script, "check"], env=dict(environment, MCORE_AUTOPATCH="0"), capture_output=True, text=True, timeout=240
    )
    assert off.returncode == 1
    # 0.13.1 starts its results-queue manager with spawn, which re-imports the script's __main__.
    selftest = subprocess.run(
        [script, "selftest"],
        env=clean_env(PYTHONPATH=mcore_folder("0.13.1")),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert selftest.returncode == 0, selftest.stdout + selftest.stderr
    assert "megatron-core 0.13.1; fix needed: no, applied: no" in selftest.stderr


def test_log_info_reports_each_applied_fix_once_on_stderr_with_pid(e2e_python):
    """MCORE_AUTOPATCH_LOG=info: one line for each fix applied to a module, naming the pid, the
    fix and (for a fix over several modules) the module; none for what needs nothing; stdout
    stays pure output."""
    proc = cli(e2e_python, ["status", "--json"], "0.12.1", MCORE_AUTOPATCH_LOG="info")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # nothing but the JSON on stdout
    lines = our_log_lines(proc.stderr)
    prefix = "mcore_autopatch[pid %d] INFO: megatron-core " % data["pid"]
    assert prefix + "write_item: applied: %s" % data["reason"] in lines
    assert len(lines) == len(set(lines))  # once each
    applied = {row["fix"] for row in data["fixes"] if row["library"] == "megatron-core" and row["applied"]}
    assert {line[len(prefix) :].split(":")[0].split(" (")[0] for line in lines} == applied
    # torch 2.13.0, numpy 1.26.4
    assert applied == {
        "write_item",
        "load_without_mcore_data",
        "write_results_per_save",
        "results_match_files",
        "writer_processes_watched",
        "async_worker_watched",
        "failed_saves_raise_everywhere",
    }

    check = cli(e2e_python, ["check"], "0.12.1", MCORE_AUTOPATCH_LOG="debug")
    assert check.returncode == 0
    assert one_line(check).startswith("ok: fix active")
    assert "mcore_autopatch[" not in check.stdout
    assert len([ln for ln in our_log_lines(check.stderr) if " INFO: megatron-core write_item: applied: " in ln]) == 1


# --- a reader that goes away ------------------------------------------------------------------


@pytest.mark.parametrize("reader", ["head -1", "true"])
def test_status_json_into_a_closed_pipe_stops_quietly(e2e_python, tmp_path, reader):
    """`status --json | head -1` and `| true` (a reader that closes before the output
    comes): no traceback, no 'Exception ignored' note; the reader's output as usual."""
    stderr = tmp_path / "stderr.txt"
    command = '"%s" -m mcore_autopatch status --json 2>"%s" | %s' % (e2e_python, stderr, reader)
    env = clean_env(PYTHONPATH=mcore_folder("0.12.1"))
    proc = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert stderr.read_text() == ""
    assert proc.stdout == ("{\n" if reader == "head -1" else "")


def test_cli_main_returns_141_and_prints_nothing_when_stdout_is_a_closed_pipe(monkeypatch, capsys):
    """The same, deterministic: every write to stdout raises BrokenPipeError."""
    import io
    import sys

    from mcore_autopatch import cli

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            raise io.UnsupportedOperation("fileno")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["check"]) == 141
    assert capsys.readouterr().err == ""


# Installers' and launchers' corners of the CLI, each over 20 s: in the matrix.
MATRIX_CELLS = {
    "test_console_script_works_like_python_m",
    "test_dockerfile_gate_passes_with_the_fix_and_fails_the_build_when_switched_off",
    "test_target_install_status_and_check_say_not_processed",
    "test_zipapp_check_exits_1_and_names_the_archive",
    "test_selftest_with_the_fix_round_trip_passes_exit_0[0.9.0]",
}
