"""FAKE ``torch.distributed.checkpoint.filesystem`` (tests/fakes/fake_torch): not torch's code.

Its ``_write_item`` is the recorded fake of ``tests/fakes/fake_torch_write_items.py`` for
the generation in ``FAKE_TORCH_GENERATION`` (2.6, 2.7 or 2.8; default 2.8), with that
generation's ``_StorageWriterTransforms`` / ``SerializationFormat`` fakes beside it.
``FAKE_TORCH_WITHOUT`` (comma-separated) names globals to leave out, to fake an upstream
that dropped or renamed them. ``FAKE_CALLS`` lists every call ``_write_item`` received.
"""

import importlib.util
import os

_here = os.path.dirname(os.path.abspath(__file__))
_source = os.path.join(_here, os.pardir, os.pardir, os.pardir, os.pardir, "fake_torch_write_items.py")
_spec = importlib.util.spec_from_file_location("fake_torch_write_items", os.path.normpath(_source))
_fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fakes)

FAKE_GENERATION = os.environ.get("FAKE_TORCH_GENERATION", "2.8")
FAKE_CALLS = _fakes.FAKE_CALLS
FAKE_TENSOR_BYTES = _fakes.FAKE_TENSOR_BYTES

_write_item = _fakes.FAKE_GENERATIONS[FAKE_GENERATION]
for _name in _fakes.FAKE_GENERATION_EXTRAS[FAKE_GENERATION]:
    globals()[_name] = _fakes.FAKE_EXTRA_OBJECTS[_name]
for _name in filter(None, os.environ.get("FAKE_TORCH_WITHOUT", "").split(",")):
    globals().pop(_name.strip(), None)
