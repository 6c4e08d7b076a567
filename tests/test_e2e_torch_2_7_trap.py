"""torch 2.7's ``safe_tensors`` trap, on real torch 2.7.1.

torch 2.7's ``_write_item`` has an optional 6th parameter, ``safe_tensors``; a truthy value
there skips ``torch.save`` for tensors, while the WriteResult still claims the tensor's
length: files without tensor bytes, i.e. silent data loss. These tests first show that this
really happens with torch's own function, then that no call the fix makes ever carries a 6th
positional argument: a recorder around torch's real ``_write_item`` (installed before
megatron-core is imported, by a script that never imports mcore_autopatch) logs every call
that reaches torch during real saves, in every forked write worker.
"""

import json
import os

import pytest
from conftest import ROOT, clean_env, compat_params, last_json, mcore_folder, run_python

pytestmark = pytest.mark.e2e

SCRIPTS = os.path.join(ROOT, "tests", "import_scripts")
HAZARD = os.path.join(SCRIPTS, "torch27_safe_tensors_hazard.py")
SPY = os.path.join(SCRIPTS, "spy_write_item.py")
JOB = os.path.join(ROOT, "examples", "checkpoint_job.py")
TORCH_2_7 = "2.7.1"


@pytest.mark.matrix
def test_truthy_sixth_positional_drops_the_tensor_bytes_on_real_torch_2_7_1(torch_python):
    """The hazard the design avoids, with torch's own _write_item (no megatron, no fix)."""
    proc = run_python(torch_python(TORCH_2_7), [HAZARD], clean_env())
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc)
    assert result["parameters"] == ["transforms", "stream", "data", "write_item", "storage_key", "safe_tensors"]
    # Five arguments: torch.save writes the tensor, and it loads back.
    assert result["five_arguments"]["loaded_equal"] is True
    assert result["five_arguments"]["bytes_written"] == result["five_arguments"]["claimed_length"] > 0
    # A truthy 6th positional: nothing written, yet the result claims the tensor's bytes.
    lost = result["truthy_sixth_positional"]
    assert lost["bytes_written"] == 0
    assert lost["claimed_length"] == result["tensor_bytes"]
    assert lost["loaded_equal"] is not True
    # The keyword that torch 2.8 requires does not exist on 2.7.
    assert "unexpected keyword argument 'serialization_format'" in result["serialization_format_keyword"]["error"]


@pytest.mark.parametrize(
    "version", compat_params(["0.9.0", "0.11.0", "0.12.1"], "every call reaching torch: no 6th positional")
)
@pytest.mark.parametrize("torch_release", [pytest.param(TORCH_2_7, id="torch" + TORCH_2_7)])
def test_no_call_reaching_torch_2_7_carries_a_sixth_positional(
    torch_python, reference_digests, tmp_path, torch_release, version
):
    """0.9-0.11 get ``transforms`` in front (five positionals), 0.12 is left alone (already
    five); with two forked workers and the rich state, every call torch sees has exactly
    five positional arguments and no keyword, and the bytes equal native 0.13.1's."""
    log = str(tmp_path / "calls.jsonl")
    folder = str(tmp_path / "ckpt")
    env = clean_env(PYTHONPATH=mcore_folder(version), SPY_WRITE_ITEM_LOG=log)
    args = [SPY, JOB, "--json", "--dir", folder, "--state", "rich", "--thread-count", "2"]
    proc = run_python(torch_python(torch_release), args, env)
    result = last_json(proc)
    assert result["ok"], result.get("traceback") or proc.stderr[-3000:]
    assert result["write_item_replaced"] is (version != "0.12.1")
    assert result["mismatched"] == []
    assert result["files"] == reference_digests("rich", 2, torch=torch_release)
    with open(log) as f:
        calls = [json.loads(line) for line in f]
    assert len({c["pid"] for c in calls}) == 2  # both forked write workers reported
    assert len(calls) == 8  # the rich state: seven tensors and one object
    assert {(c["positional"], tuple(c["keywords"]), c["sixth"]) for c in calls} == {(5, (), None)}


@pytest.mark.parametrize("torch_release", [pytest.param("2.9.0", id="torch2.9.0")])
def test_calls_reaching_torch_2_9_carry_serialization_format_by_keyword_only(torch_python, tmp_path, torch_release):
    """The seed report's torch: the format is added by keyword, never as a 6th positional."""
    log = str(tmp_path / "calls.jsonl")
    env = clean_env(PYTHONPATH=mcore_folder("0.9.0"), SPY_WRITE_ITEM_LOG=log)
    proc = run_python(torch_python(torch_release), [SPY, JOB, "--json", "--dir", str(tmp_path / "ckpt")], env)
    result = last_json(proc)
    assert result["ok"], result.get("traceback") or proc.stderr[-3000:]
    with open(log) as f:
        calls = [json.loads(line) for line in f]
    assert calls
    assert {(c["positional"], tuple(c["keywords"])) for c in calls} == {(5, ("serialization_format",))}
