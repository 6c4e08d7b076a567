"""Megatron source trees: the version is not the only evidence; the writer's own call is.

A Megatron-LM checkout copied into a job (as MindSpeed's set-up does) carries only
``megatron/core/package_info.py``, no distribution metadata, and a development tree from
before the upstream fix can already say ``0.13.0rc0``. mcore-autopatch reads, from the
writer module's code objects, whether the function that calls ``_write_item`` ever names
``serialization_format``; that overrules the version for that argument. Each tree here is a
real megatron-core release's ``megatron/`` folder copied without its dist-info, with
``package_info`` edited where the case says so, and saved with for real.
"""

import os
import re
import shutil
from typing import Any

import pytest
from conftest import compat_params, mcore_folder

pytestmark = pytest.mark.e2e

MISSING_FORMAT = "_write_item() missing 1 required positional argument: 'serialization_format'"
CALLER = "FileSystemWriterAsync.write_preloaded_data"


def source_tree(tmp_path: Any, release: str, label: "str | None" = None) -> str:
    """Release ``release``'s megatron/ folder alone (no dist-info), claiming ``label``."""
    tree = str(tmp_path / ("tree-%s-as-%s" % (release, label or release)))
    shutil.copytree(os.path.join(mcore_folder(release), "megatron"), os.path.join(tree, "megatron"))
    if label is not None:
        major, minor, patch, pre = re.match(r"(\d+)\.(\d+)\.(\d+)(.*)", label).groups()
        info = os.path.join(tree, "megatron", "core", "package_info.py")
        with open(info) as f:
            text = f.read()
        for name, value in (("MAJOR", major), ("MINOR", minor), ("PATCH", patch)):
            text = re.sub(r"(?m)^%s = \d+$" % name, "%s = %s" % (name, value), text)
        text = re.sub(r"(?m)^PRE_RELEASE = .*$", "PRE_RELEASE = %r" % pre, text)
        with open(info, "w") as f:
            f.write(text)
    return tree


@pytest.mark.parametrize("version", compat_params(["0.12.1"], "source tree labelled 0.13.0rc0: fixed by its code"))
def test_tree_claiming_0_13_0rc0_with_the_old_call_is_fixed(run_job, reference_digests, tmp_path, version):
    tree = source_tree(tmp_path, version, "0.13.0rc0")
    result = run_job(version, tree=tree, status=True)
    assert result["ok"], result.get("traceback") or result
    assert result["write_item_replaced"] is True
    assert result["files"] == reference_digests("basic")
    status = result["status"]
    assert (status["megatron_core"], status["megatron_core_source"]) == ("0.13.0rc0", "package_info")
    assert (status["needed"], status["applied"]) == (True, True)
    assert status["reason"] == (
        "megatron-core 0.13.0rc0 calls _write_item without serialization_format; torch %s requires it "
        "(read from its writer's code, %s; by its version alone it would pass it)" % (result["torch"], CALLER)
    )


def test_tree_claiming_0_13_0rc0_with_the_old_call_fails_without_the_fix(run_job, tmp_path):
    result = run_job("0.12.1", tree=source_tree(tmp_path, "0.12.1", "0.13.0rc0"), env={"MCORE_AUTOPATCH": "0"})
    assert not result["ok"]
    assert MISSING_FORMAT in result["error"]
    assert result["metadata_written"] is False


@pytest.mark.parametrize("version", compat_params(["0.13.1"], "source tree without metadata: left alone"))
def test_real_0_13_tree_without_metadata_is_left_alone(run_job, reference_digests, tmp_path, version):
    result = run_job(version, tree=source_tree(tmp_path, version), status=True)
    assert result["ok"], result.get("traceback") or result
    assert result["write_item_replaced"] is False
    assert result["files"] == reference_digests("basic")
    status = result["status"]
    assert (status["megatron_core"], status["megatron_core_source"]) == (version, "package_info")
    assert (status["needed"], status["applied"]) == (False, False)
    assert status["reason"] == "megatron-core %s passes serialization_format itself" % version


def test_tree_with_the_fix_under_an_older_label_is_left_alone(run_job, reference_digests, tmp_path):
    """The other direction: 0.13.1's writer in a tree that says 0.12.1 (a backport)."""
    result = run_job("0.13.1", tree=source_tree(tmp_path, "0.13.1", "0.12.1"), status=True)
    assert result["ok"], result.get("traceback") or result
    assert result["write_item_replaced"] is False
    assert result["files"] == reference_digests("basic")
    status = result["status"]
    assert (status["megatron_core"], status["needed"], status["applied"]) == ("0.12.1", False, False)
    assert status["reason"] == (
        "megatron-core 0.12.1 passes serialization_format itself "
        "(read from its writer's code, %s; by its version alone it would not)" % CALLER
    )


# The modules of the checkpoint path, as megatron-core's dist_checkpointing package names them.
CHECKPOINT_MODULES = (
    "strategies/filesystem_async.py",
    "strategies/torch.py",
    "strategies/state_dict_saver.py",
    "strategies/async_utils.py",
    "strategies/fully_parallel.py",
    "strategies/resharding.py",
    "exchange_utils.py",
    "mapping.py",
    "serialization.py",
)


def test_0_12_0_to_0_12_2_ship_the_same_checkpoint_modules():
    """Why the real-CUDA-torch columns run 0.12.1 for these three (tests/conftest.py)."""
    import hashlib

    def digests(release: str) -> "dict[str, str]":
        root = os.path.join(mcore_folder(release), "megatron", "core", "dist_checkpointing")
        with_digest = {}
        for name in CHECKPOINT_MODULES:
            with open(os.path.join(root, name), "rb") as f:
                with_digest[name] = hashlib.sha256(f.read()).hexdigest()
        return with_digest

    assert digests("0.12.0") == digests("0.12.1") == digests("0.12.2")
    assert digests("0.12.3")["strategies/filesystem_async.py"] != digests("0.12.1")["strategies/filesystem_async.py"]
