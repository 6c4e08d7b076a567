"""In-process measurements, run by the benchmarks with a bench venv's python:

    python bench/inprocess.py reject ROUNDS NUMBER       # find_spec reject vs an empty method
    python bench/inprocess.py count-imports              # meta_path lookups of torch + the writer
    python bench/inprocess.py fix-total                  # writer + strategies import, hook vs none
    python bench/inprocess.py fix-breakdown              # the same work, step by step, cold
    python bench/inprocess.py per-item ROUNDS ITEMS      # the safe _write_item vs torch's own
    python bench/inprocess.py torch-save MIB PATH        # torch.save + fsync of the 'large' tensor
    python bench/inprocess.py shim-job JOB ARGS...       # the job with a hand-made one-line shim
    python bench/inprocess.py results-fixes ROUNDS FILES # a queue per save, the file check
    python bench/inprocess.py failure-rows ROUNDS FILES CHECKS  # the failed-save rows when nothing fails

Each prints one JSON line. Standard library only at the top: torch, megatron-core (from
PYTHONPATH) and mcore_autopatch (installed in the venv) are imported where measured.
"""

import gc
import importlib
import json
import os
import statistics
import sys
import time
import timeit
import warnings
from typing import Any, Callable, Dict, List

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
STRATEGIES = "megatron.core.dist_checkpointing.strategies.torch"  # watched too: the mcore_data fixes
PACKAGE = "megatron.core.dist_checkpointing"
JOB_MODULES = (PACKAGE + ".strategies.fully_parallel", PACKAGE + ".exchange_utils", PACKAGE + ".strategies.common")
MARK = "__mcore_autopatch__"


def emit(result: Dict[str, Any]) -> None:
    print(json.dumps(result, sort_keys=True), flush=True)


def alternate(variants: Dict[str, Callable[[], float]], rounds: int) -> Dict[str, List[float]]:
    """One call of each variant per round, order reversed every other round; one warm-up round."""
    out: Dict[str, List[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds + 1):
        for name in names if r % 2 else names[::-1]:
            value = variants[name]()
            if r:
                out[name].append(value)
    return out


# --- find_spec reject ------------------------------------------------------------------------


class EmptyFinder:
    """The floor: a finder method that does nothing at all."""

    __slots__ = ()

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        return None


def reject(rounds: int, number: int) -> None:
    import json.decoder

    import mcore_autopatch

    ours = mcore_autopatch.installed_finder()
    if ours is None:
        raise SystemExit("mcore_autopatch's finder is not on sys.meta_path")
    finders = {"ours": ours, "empty method": EmptyFinder()}
    hack = next((f for f in sys.meta_path if type(f).__name__ == "DistutilsMetaFinder"), None)
    if hack is not None:
        finders["_distutils_hack"] = hack
    path = list(json.__path__)

    def timer(finder: Any) -> Callable[[], float]:
        # The attribute lookup is inside the timed statement, as importlib does it per call.
        t = timeit.Timer("finder.find_spec('json.decoder', path, None)", globals={"finder": finder, "path": path})
        return lambda: t.timeit(number) / number * 1e9

    assert ours.find_spec("json.decoder", path, None) is None
    ns = alternate({name: timer(f) for name, f in finders.items()}, rounds)
    emit({"ns": ns, "median_ns": {k: statistics.median(v) for k, v in ns.items()}, "number": number})


# --- how many lookups a torch job makes ------------------------------------------------------------


class CountingFinder:
    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        self.calls += 1
        return None


def count_imports() -> None:
    counter = CountingFinder()
    sys.meta_path.insert(0, counter)  # ahead of ours: sees every lookup ours sees
    warnings.simplefilter("ignore")
    import torch  # noqa: F401

    importlib.import_module(WRITER)
    sys.meta_path.remove(counter)
    emit({"find_spec_calls": counter.calls, "modules": len(sys.modules)})


# --- time to fix -----------------------------------------------------------------------------------


COLD_IMPORT_S: List[float] = []


def _load_unpatched() -> Any:
    """torch and megatron-core's checkpointing imported while MCORE_AUTOPATCH=0 kept the
    finder off; afterwards the variable is cleared so our code would act."""
    if os.environ.get("MCORE_AUTOPATCH") != "0":
        raise SystemExit("run with MCORE_AUTOPATCH=0")
    warnings.simplefilter("ignore")
    import torch  # noqa: F401

    # The cold import of megatron-core's checkpointing, torch already imported: what the
    # time to fix is a share of (its budget is 0.5 % of it).
    started = time.perf_counter()
    importlib.import_module(PACKAGE)
    writer = importlib.import_module(WRITER)
    importlib.import_module(STRATEGIES)
    for name in JOB_MODULES:  # what a training job's checkpoint path imports besides
        try:
            importlib.import_module(name)
        except ImportError:  # not in this release
            pass
    COLD_IMPORT_S.append(time.perf_counter() - started)
    import mcore_autopatch  # imported by the .pth already; its submodules are not

    if mcore_autopatch.installed_finder() is not None:
        raise SystemExit("the finder is installed although MCORE_AUTOPATCH=0")
    loaded = sorted(m for m in sys.modules if m.startswith("mcore_autopatch."))
    if loaded:
        raise SystemExit("already loaded: %s" % loaded)
    if getattr(writer._write_item, MARK, False):
        raise SystemExit("the writer is patched already")
    del os.environ["MCORE_AUTOPATCH"]
    return writer


def fix_total() -> None:
    """Execute every watched module of megatron-core that a job's checkpoint path has imported
    once more without our finder, then once with it: the difference is what the hook adds to
    those imports (our first imports, the spec lookups behind us, the loader wrappers, every
    fix's reading and decision before and after each body, and the rebindings). The plain
    execution is timed twice before and twice after the hooked one (our finder removed), and
    their median is the baseline: one plain run of ~10 ms varies by more than the difference
    on a shared 2-core machine, and runs on both sides cancel a drift."""
    _load_unpatched()
    import mcore_autopatch

    # In the order the job imported them (model code first, then the checkpointing modules).
    watched = [name for name in sys.modules if name in mcore_autopatch._WATCHED and name.startswith("megatron.")]

    def execute() -> float:
        for name in watched:
            del sys.modules[name]
        # Both executions start from a collected heap: a full collection over torch's
        # millions of objects (tens of ms), due at some allocation since startup, would
        # otherwise land at random in one of the two and swamp the difference.
        gc.collect()
        t0 = time.perf_counter()
        for name in watched:  # some import others at their top; each runs once
            importlib.import_module(name)
        return time.perf_counter() - t0

    plain = [execute(), execute()]
    assert not getattr(sys.modules[WRITER]._write_item, MARK, False)
    # What activate() does at startup (activate itself would run the callbacks for the
    # already-imported package now, importing our modules before the timed import).
    finder = mcore_autopatch._Finder(dict(mcore_autopatch._WATCHED), "bench")
    sys.meta_path.insert(0, finder)
    before = set(sys.modules)
    hooked_s = execute()
    if not getattr(sys.modules[WRITER]._write_item, MARK, False):
        raise SystemExit("the hook did not rebind _write_item")
    from mcore_autopatch import fixes

    decisions = {fix.name: fixes.last_decision(fix) for fix in fixes.FIXES if fix.library == "megatron-core"}
    new = sorted(set(sys.modules) - before - {WRITER, STRATEGIES})
    sys.meta_path.remove(finder)
    plain += [execute(), execute()]
    emit(
        {
            "plain_ms": statistics.median(plain) * 1e3,
            "cold_import_ms": COLD_IMPORT_S[0] * 1e3,
            "plain_runs_ms": [s * 1e3 for s in plain],
            "hooked_ms": hooked_s * 1e3,
            "new_modules": new,
            "decisions": decisions,
            "watched": [name[len("megatron.core.") :] for name in watched],
        }
    )


def fix_breakdown() -> None:
    """The hook's work done by hand, each step cold, in the order the hook does it."""
    writer = _load_unpatched()
    steps: Dict[str, float] = {}
    new: Dict[str, List[str]] = {}

    def step(name: str, fn: Callable[[], Any]) -> Any:
        before = set(sys.modules)
        gc.collect()  # as in fix_total
        t0 = time.perf_counter()
        value = fn()
        steps[name] = (time.perf_counter() - t0) * 1e3
        new[name] = sorted(set(sys.modules) - before)
        return value

    def import_ours() -> Any:
        from mcore_autopatch import importhook  # what the finder and the callback import
        from mcore_autopatch.fixes import write_item
        from mcore_autopatch.shared import versions

        return importhook, write_item, versions

    _, write_item, versions = step("import our modules", import_ours)
    fs = write_item.torch_filesystem()
    original = fs._write_item
    known = write_item.writers.MEGATRON_CORE
    version = step("megatron-core version (metadata)", lambda: versions.writer_version(known))
    if version.version != "0.12.1" or version.source != "metadata":
        raise SystemExit("unexpected megatron-core version reading: %r" % (version,))
    signature = step("torch signature", lambda: write_item.read_signature(original))
    call = step("writer's own call (its code objects)", lambda: write_item.read_call(writer))
    decision = step(
        "decision",
        lambda: write_item.decide(
            "auto", version, signature, versions.torch_version(), write_item.torch_has(fs), call=call
        ),
    )
    if decision.plan is None:
        raise SystemExit("no plan: %s" % decision.reason)

    def rebind() -> None:
        safe = write_item.make_safe_write_item(
            original, decision.plan, signature, fs._StorageWriterTransforms, write_item.torch_save_member(fs)
        )
        writer._write_item = safe

    step("rebinding", rebind)
    writer._write_item = original
    # The whole callback once more, now that everything above is warm.
    strategies = sys.modules[STRATEGIES]

    def import_metadata_fixes() -> Any:
        from mcore_autopatch.fixes import keep_mcore_data, load_without_mcore_data

        return keep_mcore_data, load_without_mcore_data

    keep_mcore_data, load_without_mcore_data = step("import the mcore_data fixes' modules", import_metadata_fixes)
    step(
        "keep_mcore_data: read torch's finish + megatron's stores, decide",
        lambda: keep_mcore_data.evaluate(strategies, "auto"),
    )
    step("load guard: read megatron's loader, decide", lambda: load_without_mcore_data.evaluate(strategies, "auto"))
    from mcore_autopatch import fixes

    step("on_module_executed, warm", lambda: fixes.on_module_executed(writer))
    if not getattr(writer._write_item, MARK, False):
        raise SystemExit("on_module_executed did not rebind _write_item")
    emit({"ms": steps, "new_modules": new})


# --- per-item overhead -----------------------------------------------------------------------------


def per_item(rounds: int, count: int) -> None:
    """10,000 tiny BYTE_IO items written into a BytesIO by the safe caller and by torch's
    own ``_write_item`` called with the arguments the safe caller completes the call with."""
    import io

    warnings.simplefilter("ignore")
    import torch  # noqa: F401
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    writer = importlib.import_module(WRITER)
    safe = writer._write_item
    if not getattr(safe, MARK, False):
        raise SystemExit("the writer's _write_item is not mcore_autopatch's")
    original = safe.__wrapped__
    from mcore_autopatch.fixes import write_item

    torch_save = fs.SerializationFormat.TORCH_SAVE
    transforms = fs._StorageWriterTransforms()
    items = [WriteItem(index=MetadataIndex("obj%d" % i), type=WriteItemType.BYTE_IO) for i in range(count)]
    datas = [io.BytesIO(b"%08d" % i) for i in range(count)]
    pairs = list(zip(datas, items))
    stream = io.BytesIO()
    # megatron-core 0.9-0.11 call shape: the wrapper adds transforms and the format.
    signature = write_item.read_signature(original)
    legacy = write_item.make_safe_write_item(
        original, write_item.Plan(True, True), signature, fs._StorageWriterTransforms, torch_save
    )

    def noop(transforms: Any, stream: Any, data: Any, write_item: Any, storage_key: Any, serialization_format: Any):
        return None

    safe_noop = write_item.make_safe_write_item(
        noop, write_item.Plan(False, True), signature, fs._StorageWriterTransforms, torch_save
    )
    legacy_noop = write_item.make_safe_write_item(
        noop, write_item.Plan(True, True), signature, fs._StorageWriterTransforms, torch_save
    )

    def timed(body: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            stream.seek(0)
            stream.truncate()
            t0 = time.perf_counter()
            body()
            return (time.perf_counter() - t0) / count * 1e9

        return run

    def via_safe() -> None:  # megatron-core 0.12.1's call
        for data, item in pairs:
            safe(transforms, stream, data, item, "k")

    def direct() -> None:  # what megatron-core 0.13 passes
        for data, item in pairs:
            original(transforms, stream, data, item, "k", serialization_format=torch_save)

    def via_legacy() -> None:  # megatron-core 0.11's call
        for data, item in pairs:
            legacy(stream, data, item, "k")

    def noop_safe() -> None:
        for data, item in pairs:
            safe_noop(transforms, stream, data, item, "k")

    def noop_legacy() -> None:
        for data, item in pairs:
            legacy_noop(stream, data, item, "k")

    def noop_direct() -> None:
        for data, item in pairs:
            noop(transforms, stream, data, item, "k", serialization_format=torch_save)

    via_safe()
    if len(stream.getvalue()) != 8 * count:
        raise SystemExit("the safe caller wrote %d bytes, expected %d" % (len(stream.getvalue()), 8 * count))
    ns = alternate(
        {
            "safe (0.12.1 call)": timed(via_safe),
            "safe (0.11 call)": timed(via_legacy),
            "torch direct": timed(direct),
            "wrapper around no-op": timed(noop_safe),
            "wrapper around no-op (0.11 call)": timed(noop_legacy),
            "no-op direct": timed(noop_direct),
        },
        rounds,
    )
    emit({"ns": ns, "median_ns": {k: statistics.median(v) for k, v in ns.items()}, "items": count})


# --- references for the save benchmark -------------------------------------------------------------


def torch_save(mib: int, path: str) -> None:
    """torch's own serializer on the job's 'large' tensor (same shape), into a file, fsynced:
    what any torch_dist save of that tensor must at least spend."""
    import torch

    rows = mib * 1024 * 1024 // 4 // 1024
    tensor = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(1234))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(tensor, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    size = os.path.getsize(path)
    os.remove(path)
    emit({"save_seconds": seconds, "bytes": size})


def shim_job(job: str, *args: str) -> None:
    """examples/checkpoint_job.py in a venv without mcore_autopatch, after the smallest fix a
    user could write by hand for megatron-core 0.12.x (which passes transforms already):
    ``writer._write_item = functools.partial(torch's, serialization_format=TORCH_SAVE)``.
    A reference for the rebinding's cost on the same megatron-core release, not our code."""
    import functools
    import runpy

    warnings.simplefilter("ignore")
    from torch.distributed.checkpoint import filesystem as fs

    if any(getattr(type(f), "_mcore_autopatch_finder", False) for f in sys.meta_path):
        raise SystemExit("shim-job must run without mcore_autopatch's finder")
    writer = importlib.import_module(WRITER)
    writer._write_item = functools.partial(fs._write_item, serialization_format=fs.SerializationFormat.TORCH_SAVE)
    sys.argv = [job, *args]
    runpy.run_path(job, run_name="__main__")


def failure_rows(rounds: int, files: int, checks: int) -> None:
    """What failed_saves_raise_everywhere adds when nothing fails, in a process where the hook
    applied it: once per save, the look at the save's own results queue (its item taken and put
    back, ``files`` files of the rank checked); at every done check, the all-reduce through our
    stand-in (``checks`` calls of a one-element all-reduce on a 1-rank gloo group) against the
    real one."""
    import tempfile
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    importlib.import_module(WRITER)
    async_utils = importlib.import_module(PACKAGE + ".strategies.async_utils")
    from mcore_autopatch.fixes import failed_saves_raise_everywhere as fix
    from mcore_autopatch.shared import standin

    if "distributed" not in standin.overrides(async_utils.torch):
        raise SystemExit("failed_saves_raise_everywhere is not applied here")
    writer = importlib.import_module(WRITER)
    own = writer._get_write_results_queue()  # a queue of its own, as each save gets
    folder = tempfile.mkdtemp(prefix="bench-failure-rows-")
    results = []
    for i in range(files):
        name = "__0_%d.distcp" % i
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"x" * 4096)
        results.append(SimpleNamespace(storage_data=SimpleNamespace(relative_path=name, offset=0, length=4096)))
    own.put({0: results})

    def look() -> float:
        save = fix.Save(own, [os.path.join(folder, "__0_0.distcp")])
        t0 = time.perf_counter()
        if fix.written_failure(save) is not None:
            raise SystemExit("the bench's results do not match its files")
        return time.perf_counter() - t0

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("gloo", rank=0, world_size=1)
    tensor = torch.tensor([0], dtype=torch.int)
    ours, real = async_utils.torch.distributed.all_reduce, dist.all_reduce
    caller = SimpleNamespace(process=None)  # a rank whose save is still running

    def reduce_with(all_reduce: Callable[..., Any], armed: bool) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(checks):
                if armed:
                    fix._checks.append(fix.DoneCheck(caller))
                all_reduce(tensor)
                if armed:
                    fix._checks.pop()
            return (time.perf_counter() - t0) / checks

        return run

    samples = alternate(
        {
            "look at the results": look,
            "done check, ours": reduce_with(ours, True),
            "done check, real": reduce_with(real, False),
        },
        rounds,
    )
    dist.destroy_process_group()
    emit({name: [v * 1e3 for v in values] for name, values in samples.items()})


def results_fixes(rounds: int, files: int) -> None:
    """What write_results_per_save and results_match_files add to one save, in a process where
    the hook applied them: the writer's queue (a new queue on the manager, against megatron-
    core's cached one) and the check of ``files`` files before .metadata is written."""
    import tempfile

    writer = importlib.import_module(WRITER)
    getter = writer._get_write_results_queue
    if not getattr(getter, MARK, False):
        raise SystemExit("write_results_per_save is not applied here")
    from mcore_autopatch.fixes import results_match_files

    original = getter.__wrapped__
    folder = tempfile.mkdtemp(prefix="bench-results-")
    from types import SimpleNamespace

    results = []  # what the write workers' WriteResults carry that the check reads
    for i in range(files):
        name = "__%d_0.distcp" % i
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"x" * 4096)
        results.append(SimpleNamespace(storage_data=SimpleNamespace(relative_path=name, offset=0, length=4096)))
    writer_at_folder = SimpleNamespace(path=folder)

    def queue_then_drop(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            queue = fn()
            del queue  # the writer drops its proxy after the finalize; the manager frees the queue
            return time.perf_counter() - t0

        return run

    def check() -> float:
        t0 = time.perf_counter()
        if results_match_files.mismatch(writer_at_folder, results) is not None:
            raise SystemExit("the bench's files do not match")
        return time.perf_counter() - t0

    samples = alternate(
        {"per-save queue": queue_then_drop(getter), "shared queue": queue_then_drop(original), "file check": check},
        rounds,
    )
    emit({name: [s * 1e3 for s in values] for name, values in samples.items()})


def main(argv: List[str]) -> int:
    name, args = argv[0], argv[1:]
    if name == "shim-job":
        shim_job(*args)
    elif name == "torch-save":
        torch_save(int(args[0]), args[1])
    else:
        {
            "reject": reject,
            "count-imports": count_imports,
            "fix-total": fix_total,
            "fix-breakdown": fix_breakdown,
            "per-item": per_item,
            "results-fixes": results_fixes,
            "failure-rows": failure_rows,
        }[name](*(int(a) for a in args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
