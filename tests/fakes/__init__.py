"""FAKE packages for the tests: stand-ins for what cannot be installed here.

Nothing in this folder is torch or megatron-core code; every name says ``fake``.

* ``fake_torch_write_items``: fakes of torch's ``_write_item`` for torch 2.6, 2.7 and 2.8
  (and plausible future signatures), with a fake ``SerializationFormat`` enum and a fake
  ``_StorageWriterTransforms``; each fake records the exact call it received.
* ``fake_torch/torch/...``: a FAKE ``torch`` package whose only real module is
  ``torch.distributed.checkpoint.filesystem``, for interpreters without torch. Its
  generation comes from ``FAKE_TORCH_GENERATION`` (2.6, 2.7, 2.8; default 2.8) and
  ``FAKE_TORCH_WITHOUT`` lists names it leaves out (``_write_item,SerializationFormat``).
* ``fake_megatron_0_12_1/``: a FAKE megatron-core 0.12.1: ``megatron/core/package_info.py``,
  the writer module ``megatron/core/dist_checkpointing/strategies/filesystem_async.py`` and
  a ``megatron_core-0.12.1.dist-info``. ``fake_megatron_tree`` copies it and varies it.
* ``fake_writer_without_write_item.py``: a FAKE upstream rewrite of the writer module that
  has no ``_write_item`` global.
"""

import os
import shutil
from typing import Optional

FAKES = os.path.dirname(os.path.abspath(__file__))
FAKE_TORCH = os.path.join(FAKES, "fake_torch")
FAKE_MEGATRON = os.path.join(FAKES, "fake_megatron_0_12_1")
FAKE_WRITER_WITHOUT_WRITE_ITEM = os.path.join(FAKES, "fake_writer_without_write_item.py")
WRITER_PATH = ("megatron", "core", "dist_checkpointing", "strategies", "filesystem_async.py")
DIST_INFO = "megatron_core-0.12.1.dist-info"

# Sentinel: leave the fake's own file as it is.
KEEP = object()


def fake_megatron_tree(
    target: str,
    version: str = "0.12.1",
    metadata: "Optional[str] | object" = KEEP,
    package_info: bool = True,
    writer_without_write_item: bool = False,
) -> str:
    """Copy the fake megatron-core to ``target`` (a PYTHONPATH folder) and vary it.

    ``version`` goes into both package_info and the dist-info; ``metadata`` replaces the
    METADATA text (``None`` removes the dist-info); ``package_info=False`` deletes
    ``megatron/core/package_info.py``; ``writer_without_write_item`` swaps in the rewrite.
    """
    shutil.copytree(FAKE_MEGATRON, target, ignore=shutil.ignore_patterns("__pycache__"))
    core = os.path.join(target, "megatron", "core")
    info = os.path.join(core, "package_info.py")
    if package_info:
        with open(info, "w") as f:
            f.write('"""FAKE megatron.core.package_info (tests/fakes)."""\n\n__version__ = %r\n' % version)
    else:
        os.remove(info)
    dist_info = os.path.join(target, DIST_INFO)
    if metadata is None:
        shutil.rmtree(dist_info)
    else:
        text = fake_metadata(version) if metadata is KEEP else metadata
        renamed = os.path.join(target, "megatron_core-%s.dist-info" % version)
        os.rename(dist_info, renamed)
        with open(os.path.join(renamed, "METADATA"), "w") as f:
            f.write(str(text))
    if writer_without_write_item:
        shutil.copy(FAKE_WRITER_WITHOUT_WRITE_ITEM, os.path.join(target, *WRITER_PATH))
    return target


def fake_metadata(version: "Optional[str]") -> str:
    """METADATA of the fake distribution; ``None`` leaves the Version field out."""
    lines = ["Metadata-Version: 2.1", "Name: megatron-core"]
    if version is not None:
        lines.append("Version: %s" % version)
    lines.append("Summary: FAKE megatron-core for mcore-autopatch tests (not the real package)")
    return "\n".join(lines) + "\n"
