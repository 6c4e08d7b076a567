"""Units of shared/process_watch and the three rows that fail a failed async save everywhere
(writer_processes_watched, async_worker_watched, failed_saves_raise_everywhere), with real
processes of the standard library's multiprocessing and FAKE callers shaped like megatron-core's.
The real releases, their faults and the failure without the fix are proven end to end in
tests/test_e2e_async_faults.py."""

import multiprocessing
import os
import pathlib
import queue
import signal
import time
import types

import pytest

from mcore_autopatch import fixes
from mcore_autopatch.fixes import async_worker_watched, failed_saves_raise_everywhere, write_results_per_save
from mcore_autopatch.shared import process_watch

FORK = multiprocessing.get_context("fork")


def _die(how):
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def _finish(count_queue):
    count_queue.get()
    count_queue.task_done()


def writers_context():
    return process_watch.watched_get_context(multiprocessing, process_watch.StartedHere)("fork")


def test_a_writer_killed_by_a_signal_ends_the_wait_with_its_signal():
    ctx = writers_context()
    count_queue = ctx.JoinableQueue()
    count_queue.put(0)
    writer = ctx.Process(target=_die, args=("sigkill",))
    writer.start()
    started = time.monotonic()
    with pytest.raises(process_watch.ProcessDied) as died:
        count_queue.join()
    assert time.monotonic() - started < 5
    assert "was killed by signal 9 (SIGKILL)" in str(died.value)


def test_writers_that_finish_end_the_wait_as_before():
    ctx = writers_context()
    count_queue = ctx.JoinableQueue()
    writers = []
    for _ in range(2):
        count_queue.put(0)
        writers.append(ctx.Process(target=_finish, args=(count_queue,)))
    for writer in writers:
        writer.start()
    count_queue.join()
    for writer in writers:
        writer.join()
    assert [w.exitcode for w in writers] == [0, 0]


def test_what_a_writer_was_writing_is_named():
    """megatron-core passes the WriteBucket (file, key, data) positionally (0.8 - 0.13) or by keyword."""
    bucket = (pathlib.Path("/ckpt/iter_0000002/__1_0.distcp"), "__1_", ([], []))
    assert process_watch._what_it_writes((0, bucket), {}) == "writing /ckpt/iter_0000002/__1_0.distcp"
    assert process_watch._what_it_writes((), {"write_bucket": bucket}) == "writing /ckpt/iter_0000002/__1_0.distcp"
    assert process_watch._what_it_writes((0, "x"), {}) is None


class FakeCaller:  # FAKE: the one attribute of megatron-core's callers the waits watch
    def __init__(self, process):
        self.process = process


def test_the_trainers_waits_on_a_dead_worker_end_without_raising():
    ctx = process_watch.watched_get_context(multiprocessing, process_watch.CurrentCaller)("spawn")
    preload_q, comp_q = ctx.JoinableQueue(), ctx.Queue()
    preload_q.put(0)
    worker = FORK.Process(target=_die, args=("exit",))
    worker.start()
    worker.join()
    caller = FakeCaller(worker)
    with process_watch.watching(caller):
        preload_q.join()  # ends: the worker that would have taken it is gone
        item = comp_q.get_nowait()
    assert isinstance(item, process_watch.WorkerFailure)
    assert "exited with code 3" in item.reason
    with pytest.raises(queue.Empty):  # outside a caller's method: "not yet", as before
        comp_q.get_nowait()


def test_describe_end_says_how_a_process_ended():
    assert process_watch.describe_end(types.SimpleNamespace(exitcode=None)) is None
    assert process_watch.describe_end(types.SimpleNamespace(exitcode=-11)) == "was killed by signal 11 (SIGSEGV)"
    assert process_watch.describe_end(types.SimpleNamespace(exitcode=1)) == "exited with code 1"


# --- failed_saves_raise_everywhere: this rank's verdict ---------------------------------------------


class FakeTemporal:  # FAKE: a temporal caller (no cur_item), its process and its save
    def __init__(self, exitcode):
        self.process = types.SimpleNamespace(exitcode=exitcode, name="ForkProcess-3", pid=123)


def test_a_killed_save_process_is_this_ranks_failure():
    reason = failed_saves_raise_everywhere.local_failure(FakeTemporal(-9))
    assert reason == "the async save's process ForkProcess-3 (pid 123) was killed by signal 9 (SIGKILL)"
    assert failed_saves_raise_everywhere.local_failure(FakeTemporal(None)) is None  # still writing


def test_a_write_error_on_the_saves_own_queue_is_this_ranks_failure_and_stays_for_the_finalize():
    manager = FORK.Manager()
    try:
        own = write_results_per_save._own(manager.Queue())
        own.put(OSError(28, "No space left on device"))
        caller = FakeTemporal(0)
        vars(caller)[failed_saves_raise_everywhere._SAVE] = failed_saves_raise_everywhere.Save(own, [])
        reason = failed_saves_raise_everywhere.local_failure(caller)
        assert reason == "its write failed: OSError: [Errno 28] No space left on device"
        assert isinstance(own.get_nowait(), OSError)  # put back
        assert failed_saves_raise_everywhere.local_failure(caller) == reason  # read once
    finally:
        manager.shutdown()


def test_a_queue_shared_by_every_save_is_not_read_before_the_finalize():
    caller = FakeTemporal(0)
    vars(caller)[failed_saves_raise_everywhere._SAVE] = failed_saves_raise_everywhere.Save(None, [])
    assert failed_saves_raise_everywhere.local_failure(caller) is None


class FakePersistent:  # FAKE: a persistent caller's state
    def __init__(self, exitcode, cur_item):
        self.process = types.SimpleNamespace(exitcode=exitcode, name="SpawnProcess-2", pid=7)
        self.cur_item = cur_item


def test_a_persistent_workers_failure_is_this_ranks_failure():
    dead = FakePersistent(-9, None)
    assert failed_saves_raise_everywhere.local_failure(dead).endswith("was killed by signal 9 (SIGKILL)")
    reported = FakePersistent(1, (async_worker_watched.FAILURE_TAG, "its checkpoint worker raised ValueError: x"))
    assert failed_saves_raise_everywhere.local_failure(reported) == "its checkpoint worker raised ValueError: x"
    assert failed_saves_raise_everywhere.local_failure(FakePersistent(None, None)) is None


class FakeTensor:  # FAKE: the one-element int tensor of the done check
    def __init__(self, value):
        self.value = value

    def numel(self):
        return 1

    def add_(self, n):
        self.value += n

    def zero_(self):
        self.value = 0

    def reshape(self, *_):
        return [types.SimpleNamespace(item=lambda: self.value)]


FAKE_DISTRIBUTED = types.SimpleNamespace(ReduceOp=types.SimpleNamespace(SUM="sum", MAX="max"))


@pytest.mark.parametrize("mine,theirs,failed", [(False, 0, False), (True, 0, True), (False, 1, True)])
def test_the_done_count_carries_a_failure_of_any_rank(mine, theirs, failed):
    """Two ranks: this one and another that adds FAIL_UNIT when its save failed."""
    other = failed_saves_raise_everywhere.FAIL_UNIT * theirs + 1  # the other rank still writes

    def all_reduce(tensor, op=None, group=None, async_op=False):
        tensor.value += other

    counting = failed_saves_raise_everywhere.counting_failures(all_reduce, FAKE_DISTRIBUTED)
    caller = FakeTemporal(-9 if mine else None)
    check = failed_saves_raise_everywhere.DoneCheck(caller)
    failed_saves_raise_everywhere._checks.append(check)
    try:
        tensor = FakeTensor(0 if mine else 1)
        counting(tensor)
        second = FakeTensor(5)
        counting(second, "max")  # not the done check: left alone
    finally:
        failed_saves_raise_everywhere._checks.remove(check)
    assert check.failed_anywhere is failed
    assert tensor.value == (0 if failed else 2)  # "all done" once a failure is known
    assert second.value == 5 + other


def test_the_failed_save_leaves_the_queue_without_its_finalize():
    class FakeQueue:  # FAKE: AsyncCallsQueue's deque of (idx, caller, request)
        def __init__(self, caller, other):
            self.async_calls = [
                types.SimpleNamespace(async_caller=caller),
                types.SimpleNamespace(async_caller=caller),
                types.SimpleNamespace(async_caller=other),
            ]

        def maybe_finalize_async_calls(self, blocking=False):
            raise failed_saves_raise_everywhere.save_failed(caller, {1: "the checkpoint worker was killed"})

    caller, other = object(), object()
    queue = FakeQueue(caller, other)
    finalize = failed_saves_raise_everywhere.finalizing(FakeQueue.maybe_finalize_async_calls, "q")
    with pytest.raises(BaseException) as raised:
        finalize(queue)
    assert "rank 1: the checkpoint worker was killed" in str(raised.value)
    assert [c.async_caller for c in queue.async_calls] == [other]


def test_the_three_rows_are_in_the_table_for_both_libraries():
    names = {(f.library, f.name) for f in fixes.FIXES}
    for library in ("megatron-core", "nvidia-resiliency-ext"):
        for name in ROWS:
            assert (library, name) in names


ROWS = ("writer_processes_watched", "async_worker_watched", "failed_saves_raise_everywhere")


def test_inspect_names_an_unfinished_save_and_the_iteration_to_resume_from(tmp_path):
    """Only .metadata marks a finished save: a folder with .distcp files and none is unfinished;
    the tracker's iteration (finished) is where to resume, else the newest finished one."""
    from mcore_autopatch.cli import inspect_checkpoint

    for name, files in {"iter_0000001": [".metadata", "__0_0.distcp"], "iter_0000002": ["__0_0.distcp"]}.items():
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_bytes(b"FAKE")
    assert inspect_checkpoint.unfinished_save(str(tmp_path / "iter_0000001")) is None
    report = inspect_checkpoint.unfinished_save(str(tmp_path / "iter_0000002"))
    assert report["resume_from"] == str(tmp_path / "iter_0000001")
    assert report["loads_here"].startswith("no: an unfinished save (1 .distcp files, no .metadata)")
    assert inspect_checkpoint.exit_code(report) == inspect_checkpoint.DAMAGED
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")  # names the unfinished one
    assert inspect_checkpoint.unfinished_save(str(tmp_path / "iter_0000002"))["resume_from"].endswith("iter_0000001")


def test_the_gates_rule_out_what_the_implementations_would_call_not_needed():
    """A writer of threads (megatron-core 0.17+), a module without a worker loop (0.7 - 0.11):
    the table rules the fix out without importing it, and the fix says the same."""
    from mcore_autopatch.fixes import writer_processes_watched

    threads = types.ModuleType("FAKE_filesystem_async")
    threads.FileSystemWriterAsync = type("FileSystemWriterAsync", (), {"write_preloaded_data_multithread": None})
    threads.FileSystemWriterAsync.__module__ = threads.__name__
    row = fixes.by_name("writer_processes_watched")
    assert fixes.ruled_out(row, threads) is not None
    assert writer_processes_watched.evaluate(threads, "auto").decision.needed is False
    assert writer_processes_watched.METHOD in fixes._writer_forks_its_writers.__code__.co_consts

    no_worker = types.ModuleType("FAKE_async_utils")
    no_worker.DistributedAsyncCaller = type("DistributedAsyncCaller", (), {"is_current_async_call_done": None})
    assert fixes.ruled_out(fixes.by_name("async_worker_watched"), no_worker) is not None
    assert async_worker_watched.evaluate(no_worker, "auto").decision.needed is False
