"""nvidia-resiliency-ext's async writer, installed for real (``--no-deps --target``).

Its 0.3.0 ``FileSystemWriterAsync.write_preloaded_data`` makes megatron-core 0.12's old
``_write_item`` call; 0.4.0+ reads torch's signature; 0.1.x/0.2.x have no such writer. The
same finder watches its module and the same policy decides, from torch's signature and
nvidia-resiliency-ext's own version. On the CPU the worker function is driven with CPU
buckets (tests/import_scripts/nvrx_write_bucket.py, which never imports mcore_autopatch):
0.3.0 with the wheel writes bytes equal to 0.4.1's, and fails as reported without it. The
full async save asks for CUDA: it is a GPU test, skipped with the reason elsewhere.
"""

import json
import os
from typing import Any, Dict, List

import pytest
from conftest import ROOT, clean_env, compat_params, envs, last_json, mcore_folder, run_python, torch_params

pytestmark = pytest.mark.e2e

SCRIPTS = os.path.join(ROOT, "tests", "import_scripts")
WRITE_BUCKET = os.path.join(SCRIPTS, "nvrx_write_bucket.py")
ASYNC_SAVE = os.path.join(SCRIPTS, "nvrx_async_save.py")
MISSING_FORMAT = "_write_item() missing 1 required positional argument: 'serialization_format'"
NVRX_TORCH = ["2.7.1", "2.9.0", "2.13.0"]


def nvrx_folder(version: str) -> str:
    folder = envs.nvrx_folder(version)
    if not os.path.isdir(folder):
        pytest.skip("nvidia-resiliency-ext %s folder missing: run `python3 tools/envs.py nvrx`" % version)
    return folder


def write_bucket(python: str, version: str, out: str, **env: str) -> Dict[str, Any]:
    os.makedirs(out, exist_ok=True)
    proc = run_python(python, [WRITE_BUCKET, out], clean_env(PYTHONPATH=nvrx_folder(version), **env))
    return last_json(proc)


@pytest.mark.parametrize(
    "version", compat_params(["0.3.0"], "worker function: bytes = 0.4.1's", "nvidia-resiliency-ext")
)
@pytest.mark.parametrize("torch_release", torch_params(NVRX_TORCH))
def test_nvrx_0_3_0_worker_writes_the_bytes_of_0_4_1_with_the_wheel(torch_python, tmp_path, torch_release, version):
    python = torch_python(torch_release)
    fixed = write_bucket(python, version, str(tmp_path / "fixed"))
    reference = write_bucket(python, "0.4.1", str(tmp_path / "reference"))
    assert fixed["ok"], fixed["error"]
    assert reference["ok"] and reference["write_item_replaced"] is False  # 0.4.1 is left alone
    # 2.7 needs nothing that 0.3.0 does not pass (it passes transforms): left alone there too.
    assert fixed["write_item_replaced"] is (torch_release != "2.7.1")
    assert (fixed["sha256"], fixed["results"]) == (reference["sha256"], reference["results"])


@pytest.mark.parametrize("torch_release", torch_params(NVRX_TORCH))
def test_nvrx_0_3_0_worker_fails_as_reported_without_the_fix(torch_python, tmp_path, torch_release):
    result = write_bucket(torch_python(torch_release), "0.3.0", str(tmp_path / "out"), MCORE_AUTOPATCH="0")
    assert result["write_item_replaced"] is False
    if torch_release == "2.7.1":
        assert result["ok"], result["error"]  # nothing missing on 2.7
    else:
        assert not result["ok"]
        assert result["error"] == "TypeError: " + MISSING_FORMAT


def status(python: str, paths: List[str], *args: str, **env: str):
    return run_python(python, ["-m", "mcore_autopatch", *args], clean_env(PYTHONPATH=os.pathsep.join(paths), **env))


def writer_row(info: Dict[str, Any], name: str) -> Dict[str, Any]:
    (row,) = [w for w in info["writers"] if w["name"] == name]
    return row


def test_status_shows_both_writers_and_check_covers_both(e2e_python):
    """megatron-core 0.12.1 and nvidia-resiliency-ext 0.3.0 in one interpreter."""
    paths = [mcore_folder("0.12.1"), nvrx_folder("0.3.0")]
    proc = status(e2e_python, paths, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    torch = info["torch"]
    megatron, nvrx = writer_row(info, "megatron-core"), writer_row(info, "nvidia-resiliency-ext")
    assert (info["megatron_core"], info["needed"], info["applied"]) == ("0.12.1", True, True)  # 0.1.0's keys
    assert megatron["reason"] == info["reason"]
    assert (nvrx["version"], nvrx["version_source"], nvrx["installed"], nvrx["imported"]) == (
        "0.3.0",
        "metadata",
        True,
        True,
    )
    assert (nvrx["needed"], nvrx["applied"]) == (True, True)
    assert nvrx["reason"] == (
        "nvidia-resiliency-ext 0.3.0 calls _write_item without serialization_format; torch %s requires it" % torch
    )
    assert nvrx["writer_code"] == (
        "FileSystemWriterAsync.write_preloaded_data calls _write_item without serialization_format"
    )
    text = status(e2e_python, paths, "status").stdout
    assert "  nvidia-resiliency-ext: 0.3.0 (version from metadata); fix needed: yes: " in text
    check = status(e2e_python, paths, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "fix active (nvidia-resiliency-ext 0.3.0 calls _write_item" in check.stdout

    off = status(e2e_python, [nvrx_folder("0.3.0")], "check", MCORE_AUTOPATCH="0")
    assert off.returncode == 1, off.stdout + off.stderr
    assert off.stdout.startswith("FAIL: fix needed but not active in this interpreter: MCORE_AUTOPATCH=0")
    assert "nvidia-resiliency-ext 0.3.0 calls _write_item without serialization_format" in off.stdout


NVRX_WRITER = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"


@pytest.mark.parametrize(
    "version, reason",
    [
        ("0.4.1", "nvidia-resiliency-ext 0.4.1 passes serialization_format itself"),
        ("0.2.1", "nvidia-resiliency-ext 0.2.1 has no %s: nothing to fix" % NVRX_WRITER),
    ],
)
def test_status_leaves_other_nvrx_releases_alone_with_the_reason(e2e_python, version, reason):
    proc = status(e2e_python, [nvrx_folder(version)], "status", "--json")
    assert proc.returncode == 0, proc.stderr
    nvrx = writer_row(json.loads(proc.stdout), "nvidia-resiliency-ext")
    assert (nvrx["version"], nvrx["needed"], nvrx["applied"], nvrx["reason"]) == (version, False, False, reason)
    check = status(e2e_python, [nvrx_folder(version)], "check")
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.matrix
@pytest.mark.parametrize("version", ["0.3.0", "0.4.1"])
def test_full_nvrx_async_save_on_a_gpu(torch_python, tmp_path, version):
    """GPU only: nvidia-resiliency-ext's own async path (CUDA tensors staged to the host)."""
    proc = run_python(
        torch_python("2.9.0"), [ASYNC_SAVE, str(tmp_path / "ckpt")], clean_env(PYTHONPATH=nvrx_folder(version))
    )
    result = last_json(proc)
    if "skipped" in result:
        pytest.skip("nvidia-resiliency-ext's async save needs CUDA: " + result["skipped"])
    assert result["ok"], result.get("traceback") or result
    assert result["write_item_replaced"] is (version == "0.3.0")
    assert result["loaded_equal"] is True
    assert result["metadata_written"] is True


TWO_SAVES = os.path.join(SCRIPTS, "nvrx_two_saves.py")


@pytest.mark.parametrize(
    "version",
    compat_params(["0.3.0", "0.4.1"], "two saves in flight: the first takes its own results", "nvidia-resiliency-ext"),
)
def test_nvrx_first_of_two_saves_takes_its_own_results_with_the_wheel(e2e_python, version):
    """nvidia-resiliency-ext's own getter and retrieve_write_results; the fix's row of status."""
    fixed = last_json(run_python(e2e_python, [TWO_SAVES], clean_env(PYTHONPATH=nvrx_folder(version))))
    assert fixed["queue_per_save"] is True and fixed["first_took"] == ["results of save 1"], fixed
    off = last_json(
        run_python(
            e2e_python,
            [TWO_SAVES],
            clean_env(PYTHONPATH=nvrx_folder(version), MCORE_AUTOPATCH_SKIP="write_results_per_save"),
        )
    )
    assert off["shared_queue"] is True and off["first_took"] == ["results of save 2"], off
    proc = status(e2e_python, [nvrx_folder(version)], "status", "--json")
    rows = {f["fix"]: f for f in json.loads(proc.stdout)["fixes"] if f["library"] == "nvidia-resiliency-ext"}
    for name in ("write_results_per_save", "results_match_files"):
        assert (rows[name]["needed"], rows[name]["applied"]) == (True, True), rows[name]
