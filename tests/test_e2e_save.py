"""Real megatron-core saves and loads with the wheel installed, across every release.

Each case runs examples/checkpoint_job.py in a subprocess of the e2e venv (torch 2.13.0,
our wheel from pip), with one megatron-core release on PYTHONPATH. The job never imports
mcore_autopatch. The fixed save must load back equal and write `.distcp` files
byte-identical to native megatron-core 0.13.1's; with MCORE_AUTOPATCH=0 the same job must
fail the way the bug fails.
"""

import json

import pytest
from conftest import AFFECTED, FIXED_IMPORT_ONLY, FIXED_SAVING, clean_env, compat_params, mcore_folder, run_python

pytestmark = pytest.mark.e2e


def expected_error(version: str) -> str:
    if version.startswith("0.12."):
        return "_write_item() missing 1 required positional argument: 'serialization_format'"
    return "_write_item() missing 2 required positional arguments: 'storage_key' and 'serialization_format'"


@pytest.mark.parametrize(
    "version", compat_params(AFFECTED, "async save + load round trip, `.distcp` bytes = native 0.13.1")
)
def test_affected_release_saves_and_loads_with_the_wheel(run_job, reference_digests, version):
    result = run_job(version)
    assert result["ok"], result.get("traceback") or result
    assert result["write_item_replaced"] is True
    assert result["loaded_equal"] is True
    assert result["metadata_written"] is True
    assert result["files"] == reference_digests("basic")


@pytest.mark.parametrize("version", compat_params(AFFECTED, "fails as reported with `MCORE_AUTOPATCH=0`"))
def test_affected_release_fails_without_the_fix(run_job, version):
    result = run_job(version, env={"MCORE_AUTOPATCH": "0"})
    assert not result["ok"]
    assert result["write_item_replaced"] is False
    assert result["error"].startswith("RuntimeError: Worker failure")
    assert expected_error(version) in result["error"]
    assert result["metadata_written"] is False  # no checkpoint that looks complete


@pytest.mark.parametrize("version", compat_params(["0.9.0", "0.12.1"], "every dtype, a view, objects: bytes = native"))
def test_rich_state_round_trip_is_byte_identical_to_native_0_13_1(run_job, reference_digests, version):
    """float32, bfloat16, float16, int64, uint8, bool, a non-contiguous view, objects."""
    result = run_job(version, "--state", "rich")
    assert result["ok"], result.get("traceback") or result
    assert result["mismatched"] == []
    assert result["files"] == reference_digests("rich")


@pytest.mark.parametrize("version", compat_params(FIXED_SAVING, "left untouched; saves natively"))
def test_fixed_release_is_left_untouched_and_saves(run_job, reference_digests, version):
    result = run_job(version)
    assert result["ok"], result.get("traceback") or result
    assert result["write_item_replaced"] is False
    assert result["files"] == reference_digests("basic")


def _status(e2e_python, version, **env):
    proc = run_python(
        e2e_python, ["-m", "mcore_autopatch", "status", "--json"], clean_env(PYTHONPATH=mcore_folder(version), **env)
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "version", compat_params(FIXED_SAVING + FIXED_IMPORT_ONLY, "`status`: not needed, not applied")
)
def test_status_says_fixed_releases_need_nothing(e2e_python, version):
    info = _status(e2e_python, version)
    assert info["megatron_core"] == version
    assert info["needed"] is False
    assert info["applied"] is False
    assert "passes serialization_format itself" in info["reason"]


@pytest.mark.parametrize("version", ["0.9.0", "0.12.1"])
def test_status_says_affected_releases_are_fixed(e2e_python, version):
    info = _status(e2e_python, version)
    assert info["hook_installed"] is True
    assert info["needed"] is True
    assert info["applied"] is True
    missing = "serialization_format" if version == "0.12.1" else "transforms and serialization_format"
    assert "megatron-core %s calls _write_item without %s" % (version, missing) in info["reason"]
