"""Units of write_results_per_save, results_match_files and shared/storage_layout, on FAKE writer
modules shaped like megatron-core's filesystem_async (0.7, 0.8 - 0.16, 0.17+), with real
multiprocessing managers (the standard library's; no torch). The real releases are proven
end to end in tests/test_e2e_async_results.py."""

import multiprocessing
import os
import types

import pytest

from mcore_autopatch import fixes
from mcore_autopatch.fixes import results_match_files, write_results_per_save
from mcore_autopatch.shared import storage_layout

# The shapes of megatron-core's writer module, written here (FAKE: no release's code).
FAKE_SHARED_QUEUE = """
import multiprocessing as mp
_results_queue = None

def %(getter)s(%(params)s):
    global _results_queue
    if _results_queue is None:
        _results_queue = mp.get_context("fork").Manager().Queue()
    return _results_queue

class FileSystemWriterAsync:
    def prepare_write_data(self, plan=None, planner=None):
        self.results_queue = %(getter)s()

    def retrieve_write_results(self):
        return self.results_queue.get_nowait()

    def finish(self, metadata, results):
        self.finished = (metadata, results)
"""
FAKE_OWN_DICT = """
import multiprocessing as mp

class FileSystemWriterAsync:
    def prepare_write_data(self, plan=None, planner=None):
        self.write_results = mp.get_context("fork").Manager().dict()

    def retrieve_write_results(self):
        return list(self.write_results.values())

    def finish(self, metadata, results):
        pass
"""


def fake_writer_module(source: str, name: str = "FAKE_filesystem_async") -> types.ModuleType:
    module = types.ModuleType(name, "FAKE megatron-core writer module (tests/test_async_results_fixes.py)")
    exec(compile(source, name + ".py", "exec"), vars(module))
    return module


@pytest.fixture
def shared_queue_module():
    module = fake_writer_module(FAKE_SHARED_QUEUE % {"getter": "_get_write_results_queue", "params": ""})
    yield module
    queue = vars(module).get("_results_queue")
    if queue is not None:
        queue._manager.shutdown()


def test_per_save_fix_is_needed_where_prepare_write_data_takes_a_module_global_queue(shared_queue_module):
    ev = write_results_per_save.evaluate(shared_queue_module, "auto")
    assert ev.decision.needed is True
    assert "_get_write_results_queue() (kept in _results_queue)" in ev.decision.reason


def test_per_save_fix_is_not_needed_where_each_writer_keeps_its_own_results():
    """megatron-core 0.6 / 0.7: a Manager().dict() per writer."""
    ev = write_results_per_save.evaluate(fake_writer_module(FAKE_OWN_DICT), "auto")
    assert ev.decision.needed is False
    assert "each writer has its own" in ev.decision.reason


def test_without_the_fix_two_writers_share_one_queue_and_the_first_takes_the_seconds_results(shared_queue_module):
    first, second = shared_queue_module.FileSystemWriterAsync(), shared_queue_module.FileSystemWriterAsync()
    first.prepare_write_data()
    second.prepare_write_data()
    second.results_queue.put("results of save 2")  # the later save's write ends first
    first.results_queue.put("results of save 1")
    assert first.retrieve_write_results() == "results of save 2"


def test_with_the_fix_each_writer_gets_its_own_queue_on_the_same_manager(shared_queue_module):
    decision, applied = write_results_per_save.apply(shared_queue_module, "auto")
    assert decision.needed and applied
    first, second = shared_queue_module.FileSystemWriterAsync(), shared_queue_module.FileSystemWriterAsync()
    first.prepare_write_data()
    second.prepare_write_data()
    assert first.results_queue._manager is second.results_queue._manager is shared_queue_module._results_queue._manager
    second.results_queue.put("results of save 2")
    first.results_queue.put("results of save 1")
    assert first.retrieve_write_results() == "results of save 1"
    assert second.retrieve_write_results() == "results of save 2"


def test_a_forked_write_process_puts_into_its_saves_own_queue(shared_queue_module):
    write_results_per_save.apply(shared_queue_module, "auto")
    first, second = shared_queue_module.FileSystemWriterAsync(), shared_queue_module.FileSystemWriterAsync()
    first.prepare_write_data()
    second.prepare_write_data()
    for writer, text in ((second, "save 2"), (first, "save 1")):
        process = multiprocessing.get_context("fork").Process(target=writer.results_queue.put, args=(text,))
        process.start()
        process.join()
    assert (first.retrieve_write_results(), second.retrieve_write_results()) == ("save 1", "save 2")


def test_abandoned_save_leaves_its_results_in_its_own_queue_only(shared_queue_module):
    write_results_per_save.apply(shared_queue_module, "auto")
    abandoned = shared_queue_module.FileSystemWriterAsync()
    abandoned.prepare_write_data()
    abandoned.results_queue.put("results of the abandoned save")
    following = shared_queue_module.FileSystemWriterAsync()
    following.prepare_write_data()
    following.results_queue.put("results of the next save")
    assert following.retrieve_write_results() == "results of the next save"


def test_after_an_abort_shut_the_manager_down_the_next_save_gets_a_new_one(shared_queue_module):
    write_results_per_save.apply(shared_queue_module, "auto")
    before = shared_queue_module.FileSystemWriterAsync()
    before.prepare_write_data()
    dead = shared_queue_module._results_queue
    dead._manager.shutdown()  # as an abort path does; the module still holds the dead proxy
    after = shared_queue_module.FileSystemWriterAsync()
    after.prepare_write_data()
    assert shared_queue_module._results_queue is not dead
    after.results_queue.put("results")
    assert after.retrieve_write_results() == "results"


def test_the_getter_with_parameters_of_0_17_is_served_and_passes_them_on():
    """megatron-core 0.17+ and nvidia-resiliency-ext 0.6+: get_write_results_queue(mp_mode='spawn')."""
    module = fake_writer_module(FAKE_SHARED_QUEUE % {"getter": "get_write_results_queue", "params": "mp_mode='spawn'"})
    try:
        decision, applied = write_results_per_save.apply(module, "auto")
        assert applied and "get_write_results_queue()" in decision.reason
        queue = module.get_write_results_queue(mp_mode="fork")  # what Megatron-LM's init calls
        assert queue is not module._results_queue
        assert module.get_write_results_queue.__name__ == "get_write_results_queue"
    finally:
        module._results_queue._manager.shutdown()


# The same module with its getter behind a contextmanager used as a decorator (FAKE, as above).
FAKE_DECORATED_GETTER = (
    "import contextlib\n\n@contextlib.contextmanager\ndef _disable_gc():\n    yield\n"
    + FAKE_SHARED_QUEUE % {"getter": "get_write_results_queue", "params": "mp_mode='spawn'"}
).replace("\ndef get_write_results_queue", "\n@_disable_gc()\ndef get_write_results_queue")


def test_a_getter_wrapped_in_a_decorator_is_read_through_it():
    """megatron-core 0.17+ and nvidia-resiliency-ext 0.6+ wrap the getter in ``@_disable_gc()``
    (a contextmanager used as a decorator): its wrapper's code stores no global; the getter's does."""
    module = fake_writer_module(FAKE_DECORATED_GETTER)
    try:
        decision, applied = write_results_per_save.apply(module, "auto")
        assert (decision.needed, applied) == (True, True), decision.reason
        first, second = module.get_write_results_queue(), module.get_write_results_queue()
        assert first is not second and write_results_per_save.is_own_queue(first)
    finally:
        module._results_queue._manager.shutdown()


def test_applying_twice_keeps_one_wrapper(shared_queue_module):
    write_results_per_save.apply(shared_queue_module, "auto")
    wrapper = shared_queue_module._get_write_results_queue
    write_results_per_save.apply(shared_queue_module, "auto")
    assert shared_queue_module._get_write_results_queue is wrapper
    assert write_results_per_save.is_applied(shared_queue_module)


# --- results_match_files -----------------------------------------------------------------------------


class FakeStorageInfo:  # FAKE: the fields of torch's _StorageInfo the check reads
    def __init__(self, relative_path, offset, length):
        self.relative_path, self.offset, self.length = relative_path, offset, length


class FakeWriteResult:  # FAKE: torch's WriteResult, its storage_data only
    def __init__(self, relative_path, offset, length):
        self.storage_data = FakeStorageInfo(relative_path, offset, length)

    def __eq__(self, other):  # they come back through a manager's queue: a copy
        mine, theirs = self.storage_data, getattr(other, "storage_data", None)
        return vars(mine) == vars(theirs) if theirs is not None else NotImplemented


def files(folder, sizes):
    for name, size in sizes.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"x" * size)


def writer_with_results(module, folder, results):
    """A FAKE writer of ``module`` whose queue holds ``results`` (this rank's, as its writers put them)."""
    writer = module.FileSystemWriterAsync()
    writer.path = str(folder)
    writer.prepare_write_data()
    writer.results_queue.put(results)
    return writer


def test_results_that_end_where_each_of_the_ranks_files_ends_pass(tmp_path, shared_queue_module):
    files(tmp_path, {"__0_0.distcp": 300, "__0_1.distcp": 120})
    results_match_files.apply(shared_queue_module, "auto")
    results = [FakeWriteResult("__0_0.distcp", 0, 100), FakeWriteResult("__0_0.distcp", 100, 200)]
    results.append(FakeWriteResult("__0_1.distcp", 0, 120))
    assert writer_with_results(shared_queue_module, tmp_path, results).retrieve_write_results() == results


@pytest.mark.parametrize("size,words", [(280, "20 bytes past the end"), (310, "10 bytes that no item covers")])
def test_results_of_another_save_are_this_ranks_failure_for_the_gather(tmp_path, shared_queue_module, size, words):
    """The rank's results become a wrapped exception (what torch's gather reports for a rank whose
    write failed): the coordinator writes no .metadata and names the rank."""
    files(tmp_path, {"__0_0.distcp": size})
    results_match_files.apply(shared_queue_module, "auto")
    results = [FakeWriteResult("__0_0.distcp", 0, 100), FakeWriteResult("__0_0.distcp", 100, 200)]
    failure = writer_with_results(shared_queue_module, tmp_path, results).retrieve_write_results()
    assert isinstance(failure, tuple) and isinstance(failure[0], RuntimeError)  # the FAKE module has no own type
    text = str(failure[0])
    assert "__0_0.distcp holds %d bytes, but its last item ends at 300 (%s)" % (size, words) in text
    assert "resume from another iteration" in text


def test_files_this_rank_cannot_see_are_not_checked(tmp_path, shared_queue_module):
    """An object store's files, or any not on this rank's disk: not checked, not failed."""
    results_match_files.apply(shared_queue_module, "auto")
    results = [FakeWriteResult("__7_0.distcp", 0, 100)]
    assert writer_with_results(shared_queue_module, tmp_path, results).retrieve_write_results() == results


def test_a_writer_that_is_not_a_local_folder_is_not_checked(shared_queue_module, tmp_path):
    results_match_files.apply(shared_queue_module, "auto")
    writer = writer_with_results(shared_queue_module, tmp_path, [FakeWriteResult("__0_0.distcp", 0, 100)])
    writer.path = "msc://bucket/ckpt/iter_0000010"
    assert len(writer.retrieve_write_results()) == 1


def test_a_failure_megatron_core_reports_itself_passes_through(tmp_path, shared_queue_module):
    """0.14+: retrieve_write_results returns a write error wrapped; it is left as it is."""
    results_match_files.apply(shared_queue_module, "auto")
    failure = (OSError(28, "No space left on device"), None)
    passed = writer_with_results(shared_queue_module, tmp_path, failure).retrieve_write_results()
    assert isinstance(passed, tuple) and str(passed[0]) == str(failure[0])


def test_results_match_files_is_not_needed_where_results_are_the_writers_own():
    assert results_match_files.evaluate(fake_writer_module(FAKE_OWN_DICT), "auto").decision.needed is False


def test_storage_layout_reads_the_end_and_count_of_each_file():
    infos = [FakeStorageInfo("a", 0, 10), FakeStorageInfo("a", 10, 5), FakeStorageInfo("b", 0, 7)]
    assert storage_layout.ends_by_file(infos) == {"a": (15, 2), "b": (7, 1)}


def test_both_rows_are_in_the_table_for_both_libraries():
    names = {(f.library, f.name) for f in fixes.FIXES}
    for library in ("megatron-core", "nvidia-resiliency-ext"):
        assert {(library, "write_results_per_save"), (library, "results_match_files")} <= names
