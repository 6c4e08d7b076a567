"""Fail-safe startup: a broken or unfamiliar environment never breaks the import.

Each case runs a script in a subprocess of a private venv (a clone of
``.cache/pythons/3.12``, no torch) with the wheel installed by pip, so the real
``mcore_autopatch.pth`` arms the hook. A FAKE megatron-core (``tests/fakes``) and, where
the case has one, a FAKE torch sit on ``PYTHONPATH``. The script imports the fake writer
module at ``megatron/core/dist_checkpointing/strategies/filesystem_async.py``, calls it
the way megatron-core 0.12 (or 0.9) does, and only then asks ``mcore_autopatch.status()``
(the case is about what status reports), writing everything to a JSON file so that
stdout and stderr stay what mcore-autopatch alone made them.

In every case: the import succeeds, status gives the reason, nothing is printed without
``MCORE_AUTOPATCH_LOG``, and with ``MCORE_AUTOPATCH_LOG=warning`` exactly one warning
appears when a fix was (or may have been) needed but could not be applied, none otherwise.
"""

import json
import os
import re
import subprocess
import venv
from typing import Any, Dict, List, Optional

import envs
import pytest
from conftest import clean_env, run_python
from fakes import FAKE_TORCH, fake_megatron_tree, fake_metadata

WARNING_LINE = re.compile(r"^mcore_autopatch\[pid \d+\] WARNING: ")
UNKNOWN_VERSION = "neither megatron-core's distribution metadata nor megatron.core.package_info gives a version"

# Imports the fake writer, calls it like megatron-core, then records status() to argv[1].
PROBE = r"""
import io, json, sys

out, shape = sys.argv[1], sys.argv[2]
result = {"import_error": None, "call": None}


class FakeWriterTransforms:
    # FAKE: stands in for the transforms object a megatron-core 0.12 writer holds.
    def transform_save_stream(self, write_item, stream):
        return stream, []


try:
    import packaging.version  # noqa
    result["packaging_importable"] = True
except ImportError:
    result["packaging_importable"] = False
try:
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer
except Exception as exc:
    writer = None
    result["import_error"] = "%s: %s" % (type(exc).__name__, exc)
if writer is not None:
    current = vars(writer).get("_write_item")
    result["write_item_marked"] = bool(getattr(current, "__mcore_autopatch__", False))
    try:
        if shape == "0.9":
            writer.fake_call_like_0_9(io.BytesIO(), "fake-data", "fake-item", "fake-key")
        else:
            writer.fake_call_like_0_12(FakeWriterTransforms(), io.BytesIO(), "fake-data", "fake-item", "fake-key")
        from torch.distributed.checkpoint import filesystem as fs
        last = fs.FAKE_CALLS[-1]
        result["call"] = {"ok": True, "positional": len(last.args), "keywords": sorted(last.kwargs)}
    except Exception as exc:
        result["call"] = {"ok": False, "error": "%s: %s" % (type(exc).__name__, exc)}

import mcore_autopatch

result["status"] = mcore_autopatch.status()
with open(out, "w") as f:
    json.dump(result, f, default=str)
"""


@pytest.fixture(scope="module")
def contained_python(wheel_path: str, tmp_path_factory: Any) -> str:
    """A private venv without torch, with the wheel installed by pip (once per module)."""
    folder = str(tmp_path_factory.mktemp("contained") / "venv")
    source = envs.python_venv_folder("3.12")
    if os.path.exists(envs.venv_python(source)):
        python = envs.clone_venv(source, folder)
        extra: List[str] = ["--no-deps"]  # packaging is in the clone already
    else:  # no 3.12 venv: a fresh one from this Python, packaging from the registry
        venv.EnvBuilder(with_pip=True).create(folder)
        python, extra = envs.venv_python(folder), []
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *extra, wheel_path],
        check=True,
        capture_output=True,
    )
    return python


@pytest.fixture
def probe(contained_python: str, tmp_path: Any):
    """Run PROBE with a PYTHONPATH of fake folders; return (result, stdout, stderr)."""

    def run(pythonpath: List[str], shape: str = "0.12", **env: Optional[str]):
        out = str(tmp_path / ("probe-%d.json" % len(os.listdir(tmp_path))))
        environment = clean_env(PYTHONPATH=os.pathsep.join(pythonpath), PYTHONDONTWRITEBYTECODE="1", **env)
        proc = run_python(contained_python, ["-c", PROBE, out, shape], environment, timeout=120, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        with open(out) as f:
            return json.load(f), proc.stdout, proc.stderr

    return run


@pytest.fixture
def megatron(tmp_path: Any):
    """A varied copy of the FAKE megatron-core 0.12.1 in a folder of its own."""

    def make(**variation: Any) -> str:
        return fake_megatron_tree(str(tmp_path / ("fake-megatron-%d" % len(os.listdir(tmp_path)))), **variation)

    return make


def check_contained(
    probe,
    pythonpath: List[str],
    *,
    needed: Optional[bool],
    applied: bool,
    reason: str,
    shape: str = "0.12",
    **env: str,
) -> Dict[str, Any]:
    """Run the case silent and with MCORE_AUTOPATCH_LOG=warning; check what both show."""
    silent, out, err = probe(pythonpath, shape, MCORE_AUTOPATCH_LOG=None, **env)
    assert (out, err) == ("", ""), "printed without MCORE_AUTOPATCH_LOG"
    assert silent["import_error"] is None, silent["import_error"]
    status = silent["status"]
    assert (status["needed"], status["applied"]) == (needed, applied), status
    assert reason in status["reason"], status["reason"]
    assert silent["write_item_marked"] is applied

    logged, out, err = probe(pythonpath, shape, MCORE_AUTOPATCH_LOG="warning", **env)
    assert out == ""
    lines = err.splitlines()
    expected = 0 if applied or needed is False else 1
    assert len(lines) == expected and all(WARNING_LINE.match(line) for line in lines), err
    if expected:
        assert "not applied" in lines[0] and reason in lines[0], lines[0]
    assert logged["status"]["reason"] == status["reason"]
    return silent


def test_healthy_fake_stack_is_patched_and_fails_without_the_fix(probe, megatron):
    """The control case: in this venv the hook works, and MCORE_AUTOPATCH=0 shows the bug."""
    path = [megatron(), FAKE_TORCH]
    result = check_contained(
        probe,
        path,
        needed=True,
        applied=True,
        reason="megatron-core 0.12.1 calls _write_item without serialization_format; torch 2.8.0+fake requires it",
    )
    assert result["call"] == {"ok": True, "positional": 5, "keywords": ["serialization_format"]}
    assert result["status"]["megatron_core_source"] == "metadata"
    off, out, err = probe(path, MCORE_AUTOPATCH="0")
    assert (out, err) == ("", "")
    assert off["call"]["ok"] is False
    assert "missing 1 required positional argument: 'serialization_format'" in off["call"]["error"]


def test_torch_not_importable_import_succeeds_and_status_says_why(probe, megatron):
    result = check_contained(
        probe,
        [megatron()],
        needed=None,
        applied=False,
        reason="torch.distributed.checkpoint.filesystem has no _write_item; not patching",
    )
    assert result["status"]["torch"] is None


def test_torch_filesystem_without_write_item_not_patched_with_one_warning(probe, megatron):
    check_contained(
        probe,
        [megatron(), FAKE_TORCH],
        needed=None,
        applied=False,
        reason="torch.distributed.checkpoint.filesystem has no _write_item; not patching",
        FAKE_TORCH_WITHOUT="_write_item",
    )


def test_torch_without_serialization_format_not_patched_with_one_warning(probe, megatron):
    result = check_contained(
        probe,
        [megatron(), FAKE_TORCH],
        needed=True,
        applied=False,
        reason="but torch has no SerializationFormat to supply; not patching",
        FAKE_TORCH_WITHOUT="SerializationFormat",
    )
    assert result["call"]["ok"] is False  # megatron-core's own failure, untouched


def test_torch_without_storage_writer_transforms_not_patched_for_0_11_with_one_warning(probe, megatron):
    check_contained(
        probe,
        [megatron(version="0.11.0"), FAKE_TORCH],
        needed=True,
        applied=False,
        reason="but torch has no _StorageWriterTransforms to supply; not patching",
        shape="0.9",
        FAKE_TORCH_WITHOUT="_StorageWriterTransforms",
    )


def test_torch_without_storage_writer_transforms_still_patched_for_0_12(probe, megatron):
    """0.12 passes its writer's transforms itself: only serialization_format is supplied."""
    result = check_contained(
        probe,
        [megatron(), FAKE_TORCH],
        needed=True,
        applied=True,
        reason="without serialization_format",
        FAKE_TORCH_WITHOUT="_StorageWriterTransforms",
    )
    assert result["call"] == {"ok": True, "positional": 5, "keywords": ["serialization_format"]}


def test_packaging_missing_fix_still_applied(probe, megatron, tmp_path):
    """A shadowing FAKE ``packaging`` that raises ImportError: the plain version reading takes over."""
    shadow = tmp_path / "fake-packaging-shadow" / "packaging"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        '"""FAKE packaging (tests): makes ``import packaging`` fail."""\n'
        'raise ImportError("fake: packaging is missing in this environment")\n'
    )
    result = check_contained(
        probe,
        [str(shadow.parent), megatron(), FAKE_TORCH],
        needed=True,
        applied=True,
        reason="megatron-core 0.12.1 calls _write_item without serialization_format",
    )
    assert result["packaging_importable"] is False
    assert result["call"]["ok"] is True


def test_megatron_metadata_without_version_falls_back_to_package_info(probe, megatron):
    result = check_contained(
        probe,
        [megatron(metadata=fake_metadata(None)), FAKE_TORCH],
        needed=True,
        applied=True,
        reason="megatron-core 0.12.1 calls _write_item without serialization_format",
    )
    assert result["status"]["megatron_core_source"] == "package_info"


def test_megatron_metadata_invalid_version_falls_back_to_package_info(probe, megatron):
    result = check_contained(
        probe,
        [megatron(metadata=fake_metadata("not-a-version")), FAKE_TORCH],
        needed=True,
        applied=True,
        reason="megatron-core 0.12.1 calls _write_item without serialization_format",
    )
    assert result["status"]["megatron_core_source"] == "package_info"


def test_megatron_without_package_info_uses_metadata(probe, megatron):
    result = check_contained(
        probe,
        [megatron(package_info=False), FAKE_TORCH],
        needed=True,
        applied=True,
        reason="megatron-core 0.12.1 calls _write_item without serialization_format",
    )
    assert result["status"]["megatron_core_source"] == "metadata"


@pytest.mark.parametrize("metadata", ["without-version", "invalid-version", "absent"])
def test_megatron_broken_metadata_and_no_package_info_not_patched_with_one_warning(probe, megatron, metadata):
    text = {"without-version": fake_metadata(None), "invalid-version": fake_metadata("not-a-version"), "absent": None}
    check_contained(
        probe,
        [megatron(metadata=text[metadata], package_info=False), FAKE_TORCH],
        needed=None,
        applied=False,
        reason=UNKNOWN_VERSION + "; set MCORE_AUTOPATCH=force to patch anyway",
    )


def test_writer_without_write_item_global_not_patched_with_one_warning(probe, megatron):
    """An upstream rewrite that reaches torch through the module: nothing to rebind."""
    check_contained(
        probe,
        [megatron(writer_without_write_item=True), FAKE_TORCH],
        needed=None,
        applied=False,
        reason="megatron.core.dist_checkpointing.strategies.filesystem_async has no _write_item global "
        "(an upstream rewrite?); not patching",
    )


def test_unknown_mode_value_warns_once_and_behaves_as_auto(probe, megatron):
    path = [megatron(), FAKE_TORCH]
    silent, out, err = probe(path, MCORE_AUTOPATCH="sometimes")
    assert (out, err) == ("", "")
    assert silent["status"]["applied"] is True
    _, out, err = probe(path, MCORE_AUTOPATCH="sometimes", MCORE_AUTOPATCH_LOG="warning")
    lines = err.splitlines()
    assert len(lines) == 1 and WARNING_LINE.match(lines[0]), err
    assert "MCORE_AUTOPATCH has an unknown value; behaving as 'auto'" in lines[0]
