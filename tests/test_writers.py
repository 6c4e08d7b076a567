"""The table of known writers, and the evidence read from a writer's own code.

``write_item.read_call`` looks at the code objects of the functions a writer module defines:
which of them call ``_write_item``, and whether each names ``serialization_format``. The
modules here are FAKE writer modules compiled from small sources (no megatron-core code);
the real trees, including a 0.12.1 tree relabelled 0.13.0rc0, are in
``tests/test_e2e_source_trees.py``.
"""

import textwrap
import types
from typing import Optional

import pytest

import mcore_autopatch
from mcore_autopatch import fixes
from mcore_autopatch.fixes import write_item
from mcore_autopatch.shared import versions, writers
from mcore_autopatch.shared.values import Decision

FAKE_MODULE = "fake_writers.filesystem_async"
TORCH_2_8_SIGNATURE = write_item.WriteItemSignature(
    "_write_item(transforms, stream, data, write_item, storage_key, serialization_format)",
    takes_transforms=True,
    format_index=5,
    has_format=True,
    format_required=True,
)


def fake_writer_module(source: str, name: str = FAKE_MODULE) -> types.ModuleType:
    """A module named ``name`` whose functions are defined by ``source`` (so they are its own)."""
    module = types.ModuleType(name, "FAKE writer module (tests/test_writers.py)")
    prelude = "import functools, contextlib\n_write_item = print  # FAKE: stands in for torch's\n"
    exec(compile(prelude + textwrap.dedent(source), "<fake %s>" % name, "exec"), vars(module))
    return module


# --- the table ------------------------------------------------------------------------------


def test_startup_watch_list_matches_the_table_of_fixes():
    """The startup room cannot import the table (fixes/); its watch list must name the same modules."""
    assert set(mcore_autopatch._WATCHED) == fixes.watched_modules()
    assert all(hooks == mcore_autopatch._HOOKS for hooks in mcore_autopatch._WATCHED.values())
    assert {w.module for w in writers.KNOWN_WRITERS} <= fixes.watched_modules()
    assert {name for w in writers.KNOWN_WRITERS for name in w.importers} <= fixes.watched_modules()
    assert writers.MEGATRON_CORE.module == mcore_autopatch.WRITER_MODULE
    assert writers.NVIDIA_RESILIENCY_EXT.module == mcore_autopatch.NVRX_WRITER_MODULE


def test_each_known_writer_has_its_own_module_and_ordered_releases():
    assert len(writers.BY_MODULE) == len(writers.KNOWN_WRITERS)
    for writer in writers.KNOWN_WRITERS:
        assert writer.passes_transforms_from <= writer.fixed_in
        assert writer.distributions and all(writer.distributions)
        assert writers.for_module(writer.module) is writer
    assert writers.for_module("some.other.module") is None


# --- read_call ------------------------------------------------------------------------------


def test_read_call_finds_a_staticmethod_behind_a_wraps_decorator():
    """The shape of megatron-core's write_preloaded_data: @staticmethod over @_disable_gc()."""
    module = fake_writer_module(
        """
        @contextlib.contextmanager
        def fake_disable_gc():
            yield

        class FakeWriterAsync:
            @staticmethod
            @fake_disable_gc()
            def write_preloaded_data(transform_list, stream, data, item, key):
                return _write_item(*transform_list, stream, data, item, key)
        """
    )
    call = write_item.read_call(module)
    assert call.callers == ("FakeWriterAsync.write_preloaded_data",)
    assert call.without_format == ("FakeWriterAsync.write_preloaded_data",)
    assert call.passes_format is False


@pytest.mark.parametrize(
    "body",
    [
        "return _write_item(t, s, d, i, k, serialization_format=fmt)",  # a keyword name
        "kw = {'serialization_format': fmt}\n    return _write_item(t, s, d, i, k, **kw)",  # a dict key
        "return _write_item(t, s, d, i, k, SerializationFormat.TORCH_SAVE)",  # torch's enum
        "return functools.partial(_write_item, t)(s, d, i, k, serialization_format=fmt)",  # through partial
    ],
    ids=["keyword", "dict-key", "enum", "partial"],
)
def test_read_call_sees_each_way_of_passing_the_format(body):
    module = fake_writer_module("def fake_write(t, s, d, i, k, fmt=None):\n    %s\n" % body)
    assert write_item.read_call(module).passes_format is True


def test_read_call_ignores_docstrings_and_messages_that_mention_the_format():
    module = fake_writer_module(
        '''
        def fake_write(t, s, d, i, k):
            """Does not pass serialization_format (torch 2.8 will complain)."""
            print("serialization_format is missing here")
            return _write_item(t, s, d, i, k)
        '''
    )
    assert write_item.read_call(module).passes_format is False


def test_read_call_one_caller_without_the_format_is_the_old_call():
    module = fake_writer_module(
        """
        def fake_new(t, s, d, i, k, fmt):
            return _write_item(t, s, d, i, k, serialization_format=fmt)

        def fake_old(t, s, d, i, k):
            return _write_item(t, s, d, i, k)
        """
    )
    call = write_item.read_call(module)
    assert set(call.callers) == {"fake_new", "fake_old"}
    assert call.without_format == ("fake_old",)
    assert call.passes_format is False


def test_read_call_looks_into_nested_functions():
    module = fake_writer_module(
        """
        def fake_outer(items):
            def each(item):
                return _write_item(*item)
            return [each(i) for i in items]
        """
    )
    assert write_item.read_call(module).callers == ("fake_outer",)


def test_read_call_ignores_functions_imported_from_elsewhere():
    """torch's _write_item itself (or our safe caller) is a global of the module, not its code."""
    module = fake_writer_module("from os.path import join\n")
    module.fake_imported = types.FunctionType(compile("_write_item()", "<x>", "exec"), {}, "fake_imported")
    module.fake_imported.__module__ = "somewhere.else"
    assert write_item.read_call(module) == write_item.NO_CALL_FOUND
    assert write_item.read_call(module).passes_format is None


def test_read_call_of_a_module_that_cannot_be_walked_gives_no_evidence():
    """A member whose attributes raise (a lazy proxy, say): the version decides, nothing raises."""

    class FakeExplodingProxy:
        def __getattribute__(self, name):
            raise RuntimeError("fake: proxy exploded on %s" % name)

    module = fake_writer_module("def fake_write(t, s, d, i, k):\n    return _write_item(t, s, d, i, k)\n")
    module.fake_proxy = FakeExplodingProxy()
    assert write_item.read_call(module) == write_item.NO_CALL_FOUND


def test_read_call_of_a_module_without_callers_finds_nothing():
    module = fake_writer_module("def fake_unrelated():\n    return 1\n")
    call = write_item.read_call(module)
    assert (call.callers, call.passes_format) == ((), None)
    assert call.text == "no function calling _write_item found in its code"


# --- the decision with that evidence --------------------------------------------------------

OLD_CALL = write_item.CallEvidence(("FakeWriterAsync.write_preloaded_data",), ("FakeWriterAsync.write_preloaded_data",))
NEW_CALL = write_item.CallEvidence(("FakeWriterAsync.write_preloaded_data",), ())


def decide(version: Optional[str], call: write_item.CallEvidence, writer=writers.MEGATRON_CORE) -> Decision:
    known = versions.WriterVersion(version, versions.parse_release(version), "package_info")
    if version is None:
        known = versions.WriterVersion(None, None, "no version anywhere")
    return write_item.decide("auto", known, TORCH_2_8_SIGNATURE, "2.8.0", lambda name: True, writer, call)


def test_decide_code_with_the_old_call_overrules_a_version_that_claims_the_fix():
    d = decide("0.13.0rc0", OLD_CALL)
    assert (d.needed, d.plan) == (True, write_item.Plan(False, True))
    assert d.reason == (
        "megatron-core 0.13.0rc0 calls _write_item without serialization_format; torch 2.8.0 requires it "
        "(read from its writer's code, FakeWriterAsync.write_preloaded_data; by its version alone it would pass it)"
    )


def test_decide_code_that_passes_the_format_overrules_an_older_version():
    d = decide("0.12.1", NEW_CALL)
    assert (d.needed, d.plan) == (False, None)
    assert d.reason == (
        "megatron-core 0.12.1 passes serialization_format itself "
        "(read from its writer's code, FakeWriterAsync.write_preloaded_data; by its version alone it would not)"
    )


@pytest.mark.parametrize("version, needed", [("0.12.1", True), ("0.13.1", False)])
def test_decide_without_callers_found_the_version_decides(version, needed):
    d = decide(version, write_item.NO_CALL_FOUND)
    assert d.needed is needed
    assert "read from its writer's code" not in d.reason


def test_decide_code_agreeing_with_the_version_adds_no_note():
    assert decide("0.12.1", OLD_CALL).reason == (
        "megatron-core 0.12.1 calls _write_item without serialization_format; torch 2.8.0 requires it"
    )
    assert decide("0.13.1", NEW_CALL).reason == "megatron-core 0.13.1 passes serialization_format itself"


def test_decide_unknown_version_stays_cannot_tell_whatever_the_code():
    """The code tells what the call lacks, not which release this is: auto still waits for force."""
    d = decide(None, OLD_CALL)
    assert (d.needed, d.plan) == (None, None)
    assert d.reason == "no version anywhere; set MCORE_AUTOPATCH=force to patch anyway"


@pytest.mark.parametrize("version, needed", [("0.3.0", True), ("0.4.0", False), ("0.4.1", False)])
def test_decide_for_nvidia_resiliency_ext_uses_its_own_releases(version, needed):
    d = decide(version, write_item.NO_CALL_FOUND, writers.NVIDIA_RESILIENCY_EXT)
    assert d.needed is needed
    assert d.reason.startswith("nvidia-resiliency-ext %s " % version)
