"""Failing writes with the wheel installed: the save still raises, and promptly.

The fix only supplies the arguments megatron-core's writer leaves out; it must not swallow a
real write failure, turn it into a hang, or let a failed save leave a checkpoint that looks
complete (a ``.metadata`` file). Each case runs examples/checkpoint_job.py (which never imports
mcore_autopatch) in its own session, under a time limit past which the run counts as hung and
its process group is killed. Each case is also run with MCORE_AUTOPATCH=0, to show how the
unfixed writer fails there.

A failing disk is injected with the job's ``--fail-fsync`` (os.fsync raises in the forked
write workers, after the bytes are written). A read-only folder and a full disk are real: a
read-only bind mount or an unprivileged user (the tests run as root, for whom chmod alone
does not stop writes), and a tiny tmpfs, both in a private mount namespace.
"""

import os
import shutil
import signal
import subprocess
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
from conftest import JOB, clean_env, last_json, mcore_folder

pytestmark = pytest.mark.e2e

INJECTED = "Input/output error (injected by checkpoint_job --fail-fsync)"
MISSING_FORMAT = "_write_item() missing 1 required positional argument: 'serialization_format'"
MISSING_TWO = "_write_item() missing 2 required positional arguments: 'storage_key' and 'serialization_format'"
APPLIED = (
    "INFO: megatron-core write_item: applied: megatron-core"  # MCORE_AUTOPATCH_LOG=info: the fix was active in the job
)
HANG_LIMIT = 300  # seconds; a save takes a few. Past this the run is a hang, not a slow save.
NOBODY = "65534"


def expected_type_error(version: str) -> str:
    return MISSING_FORMAT if version.startswith("0.12.") else MISSING_TWO


def run_bounded(cmd: Sequence[str], env: Dict[str, str], timeout: float = HANG_LIMIT) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; past ``timeout`` kill its process group and fail."""
    proc = subprocess.Popen(
        list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the job, its ranks and write workers
        out, err = proc.communicate()
        pytest.fail("the failing save hung: no result after %ss\nstderr:\n%s" % (timeout, err[-4000:]))
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def run_failing_job(
    python: str,
    version: str,
    folder: str,
    *args: str,
    env: Optional[Dict[str, str]] = None,
    wrap: Sequence[str] = (),
) -> Dict[str, Any]:
    environment = clean_env(PYTHONPATH=mcore_folder(version), MCORE_AUTOPATCH_LOG="info", **(env or {}))
    proc = run_bounded([*wrap, python, JOB, "--json", "--dir", folder, *args], environment)
    result = last_json(proc)
    result["stderr"] = proc.stderr
    result["returncode"] = proc.returncode
    return result


def distcp_files(folder: str) -> List[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".distcp"))


# --- a failing fsync --------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, args, files",
    [
        ("0.9.0", [], 1),
        ("0.12.1", ["--state", "rich", "--thread-count", "4"], 4),
    ],
    ids=["0.9.0-one-worker", "0.12.1-four-workers"],
)
def test_failing_fsync_makes_the_fixed_save_raise_without_metadata(e2e_python, tmp_path, version, args, files):
    """The fixed writer writes every bucket, then fsync fails: that error must reach the save."""
    folder = str(tmp_path / "ckpt")
    result = run_failing_job(e2e_python, version, folder, "--fail-fsync", *args)
    assert result["returncode"] == 1 and not result["ok"]
    assert result["write_item_replaced"] is True
    assert result["error"].startswith("RuntimeError: Worker failure"), result["error"]
    assert INJECTED in result["error"]
    assert distcp_files(folder) == ["__0_%d.distcp" % i for i in range(files)]  # the writes themselves ran
    assert result["metadata_written"] is False
    assert not os.path.exists(os.path.join(folder, ".metadata"))


@pytest.mark.parametrize("version", ["0.9.0", "0.12.1"])
def test_failing_fsync_without_the_fix_fails_earlier_with_the_type_error(e2e_python, tmp_path, version):
    """Unfixed, the first _write_item call raises, before any fsync."""
    folder = str(tmp_path / "ckpt")
    result = run_failing_job(e2e_python, version, folder, "--fail-fsync", env={"MCORE_AUTOPATCH": "0"})
    assert result["returncode"] == 1 and not result["ok"]
    assert result["write_item_replaced"] is False
    assert expected_type_error(version) in result["error"]
    assert INJECTED not in result["error"]
    assert result["metadata_written"] is False


def test_failing_fsync_on_two_ranks_makes_every_rank_raise(e2e_python, tmp_path):
    """Each rank's own workers fail; neither rank waits forever on the other at finalize."""
    folder = str(tmp_path / "ckpt")
    result = run_failing_job(e2e_python, "0.12.1", folder, "--fail-fsync", "--launch", "2")
    assert not result["ok"]
    assert sorted(rank["rank"] for rank in result["ranks"]) == [0, 1]
    for rank in result["ranks"]:
        assert rank["write_item_replaced"] is True
        assert INJECTED in rank["error"], rank["error"]
        assert rank["metadata_written"] is False
    assert not os.path.exists(os.path.join(folder, ".metadata"))


# --- a read-only folder -----------------------------------------------------------------

# In a private mount namespace: bind the folder onto itself read-only, then run the command.
RO_MOUNT = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'
TMPFS_MOUNT = 'mount -t tmpfs -o size=256k tmpfs "$1" && shift && exec "$@"'


def in_mount_namespace(script: str, folder: str) -> List[str]:
    return ["unshare", "--mount", "sh", "-c", script, "sh", folder]


def probe(cmd: Sequence[str], env: Optional[Dict[str, str]] = None) -> Tuple[int, str]:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=120, env=env)
    except OSError as exc:
        return -1, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def read_only_mount(tmp_path: Any) -> Tuple[str, List[str], str]:
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    if shutil.which("unshare") is None:
        pytest.skip("read-only bind mount: no unshare(1) on this machine")
    wrap = in_mount_namespace(RO_MOUNT, folder)
    rc, out = probe([*wrap, "touch", os.path.join(folder, "probe")])
    if rc == 0 or "Read-only file system" not in out:
        pytest.skip("read-only bind mount not possible here (probe rc=%s): %s" % (rc, out[-500:]))
    return folder, wrap, "Read-only file system"


def nobody_folder() -> str:
    """A root-owned 0555 folder that nobody can reach (tmp_path's parents are root-only)."""
    base = tempfile.mkdtemp(prefix="mcore-autopatch-ro-")
    os.chmod(base, 0o755)
    folder = os.path.join(base, "ckpt")
    os.makedirs(folder)
    os.chmod(folder, 0o555)
    return folder


def remove_nobody_folder(folder: str) -> None:
    os.chmod(folder, 0o755)
    shutil.rmtree(os.path.dirname(folder), ignore_errors=True)


@pytest.fixture(scope="session")
def as_nobody(e2e_python: str) -> Tuple[Optional[List[str]], str]:
    """(command prefix that runs the job unprivileged, or None; what the probe found)."""
    wrap: List[str] = []
    if os.geteuid() == 0:  # as root, chmod alone does not stop writes
        if shutil.which("setpriv") is None:
            return None, "running as root and no setpriv(1) on this machine"
        wrap = ["setpriv", "--reuid=" + NOBODY, "--regid=" + NOBODY, "--clear-groups"]
    folder = nobody_folder()
    try:
        check = "import torch, megatron.core.dist_checkpointing; open(%r, 'w')" % os.path.join(folder, "probe")
        rc, out = probe([*wrap, e2e_python, "-c", check], clean_env(PYTHONPATH=mcore_folder("0.12.1")))
    finally:
        remove_nobody_folder(folder)
    if rc == 0 or "PermissionError" not in out:
        return None, "the job cannot run unprivileged, or can write the folder (probe rc=%s): %s" % (rc, out[-500:])
    return wrap, "ok"


def unprivileged_user(as_nobody: Tuple[Optional[List[str]], str]) -> Tuple[str, List[str], str]:
    wrap, found = as_nobody
    if wrap is None:
        pytest.skip("unprivileged user: " + found)
    return nobody_folder(), wrap, "Permission denied"


@pytest.fixture(params=["read-only-bind-mount", "unprivileged-user"])
def read_only_folder(request: Any, tmp_path: Any) -> Any:
    """(folder, command prefix that makes the folder read-only for the job, expected strerror)."""
    if request.param == "read-only-bind-mount":
        yield read_only_mount(tmp_path)
        return
    folder, wrap, strerror = unprivileged_user(request.getfixturevalue("as_nobody"))
    try:
        yield folder, wrap, strerror
    finally:
        remove_nobody_folder(folder)


def test_read_only_folder_makes_the_fixed_save_raise_without_metadata(e2e_python, read_only_folder):
    """megatron-core writes common.pt on rank 0 first: the save fails there, at once."""
    folder, wrap, strerror = read_only_folder
    result = run_failing_job(e2e_python, "0.12.1", folder, "--no-load", wrap=wrap)
    assert APPLIED in result["stderr"]  # the fix was active in this job
    assert result["returncode"] == 1 and not result["ok"]
    assert strerror in result["error"], result["error"]
    assert result["metadata_written"] is False
    assert os.listdir(folder) == []


def test_read_only_folder_without_the_fix_fails_the_same_way(e2e_python, read_only_folder):
    """Not the TypeError: the failure comes before any write worker, fixed or not."""
    folder, wrap, strerror = read_only_folder
    result = run_failing_job(e2e_python, "0.12.1", folder, "--no-load", env={"MCORE_AUTOPATCH": "0"}, wrap=wrap)
    assert APPLIED not in result["stderr"]
    assert result["returncode"] == 1 and not result["ok"]
    assert strerror in result["error"], result["error"]
    assert MISSING_FORMAT not in result["error"]
    assert result["metadata_written"] is False


# --- a full disk ------------------------------------------------------------------------


@pytest.fixture
def full_disk(tmp_path: Any) -> Tuple[str, List[str]]:
    """A 256 KiB tmpfs as the checkpoint folder: common.pt fits, a 1 MiB tensor does not."""
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    if shutil.which("unshare") is None:
        pytest.skip("full disk: no unshare(1) on this machine")
    wrap = in_mount_namespace(TMPFS_MOUNT, folder)
    rc, out = probe([*wrap, "sh", "-c", 'head -c 300000 /dev/zero > "$1/probe"', "sh", folder])
    if rc == 0 or "No space left on device" not in out:
        pytest.skip("small tmpfs not possible here (probe rc=%s): %s" % (rc, out[-500:]))
    return folder, wrap


def test_full_disk_makes_the_fixed_save_raise_in_the_write_worker(e2e_python, full_disk):
    """Here the failure comes from inside torch's _write_item, called through our safe caller."""
    folder, wrap = full_disk
    result = run_failing_job(e2e_python, "0.12.1", folder, "--state", "large", "--mib", "1", "--no-load", wrap=wrap)
    assert result["returncode"] == 1 and not result["ok"]
    assert result["write_item_replaced"] is True
    assert result["error"].startswith("RuntimeError: Worker failure"), result["error"]
    assert MISSING_FORMAT not in result["error"]
    assert result["metadata_written"] is False


def test_full_disk_without_the_fix_fails_earlier_with_the_type_error(e2e_python, full_disk):
    folder, wrap = full_disk
    result = run_failing_job(
        e2e_python,
        "0.12.1",
        folder,
        "--state",
        "large",
        "--mib",
        "1",
        "--no-load",
        env={"MCORE_AUTOPATCH": "0"},
        wrap=wrap,
    )
    assert result["returncode"] == 1 and not result["ok"]
    assert result["write_item_replaced"] is False
    assert MISSING_FORMAT in result["error"]
    assert result["metadata_written"] is False
