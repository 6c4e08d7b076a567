"""The table of fixes, and the two callbacks the import hook runs for all of them.

Each fix names the modules whose execution triggers it, what it reads from torch's and the
library's code and what it rebinds. It is implemented by the module of its name in this
folder (``fixes/write_item.py`` for ``write_item``: the name ``status``, the logs and
``MCORE_AUTOPATCH_SKIP`` use). An implementation has three functions, each taking one
watched module:

* ``evaluate(module, mode)``: read and decide, changing nothing (``status`` uses it too);
* ``apply(module, mode)``: decide and rebind when needed; returns ``(decision, applied)``;
* ``is_applied(module)``: whether its rebinding is in place now;

and, for a fix that must act while the module's body runs, ``before(module, mode)``, which
returns what to call once the body has run.

A new fix is one row here, its watched modules in the startup watch list of
``mcore_autopatch/__init__.py`` (a test checks the two agree), ``fixes/<name>.py`` and its
tests; what several fixes share is in ``mcore_autopatch/shared/``. ``before_module_executes``
and ``on_module_executed`` are what ``importhook`` calls; they never raise.
``MCORE_AUTOPATCH_SKIP`` names fixes to leave out (they are still read and reported).
"""

from __future__ import annotations

import importlib
import os
import sys
import weakref
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

import mcore_autopatch
from mcore_autopatch.shared import writers
from mcore_autopatch.shared.log import logger
from mcore_autopatch.shared.values import Record

STRATEGIES_TORCH = mcore_autopatch.IMPORTER_MODULE  # one name, in the startup watch list
SKIP_ENV = "MCORE_AUTOPATCH_SKIP"
_DC = "megatron.core.dist_checkpointing."


class Fix(Record):
    """One row of the table.

    ``name``: what it fixes, as status, logs and MCORE_AUTOPATCH_SKIP name it; ``library``:
    the distribution whose modules are watched, as users know it; ``watches``: the modules
    whose execution triggers it; its implementation, ``fixes/<name>.py``, has evaluate / apply /
    is_applied (and ``before`` when ``acts_while_executing``). ``importers``: modules that
    import a watched module at their top: when one executes and the watched module was
    loaded without our finder (a finder ahead of ours), the fix is applied then. ``gate``: a
    necessary condition, read without importing the implementation (a function of this
    module: the watched module -> None, or why the fix is not needed there), so that a
    process pays for a fix's module only where it may act.
    """

    __slots__ = (
        "acts_while_executing",
        "gate",
        "importers",
        "library",
        "name",
        "reads",
        "rebinds",
        "watches",
    )

    def __init__(
        self,
        name: str,
        library: str,
        watches: Tuple[str, ...],
        reads: str,
        rebinds: str,
        importers: Tuple[str, ...] = (),
        gate: str = "",
        acts_while_executing: bool = False,
    ) -> None:
        self.name = name
        self.library = library
        self.watches = watches
        self.reads = reads
        self.rebinds = rebinds
        self.importers = importers
        self.gate = gate
        self.acts_while_executing = acts_while_executing

    @property
    def key(self) -> str:
        return "%s %s" % (self.library, self.name)

    @property
    def implementation(self) -> str:
        """The module that implements it: ``mcore_autopatch/fixes/<name>.py``, always."""
        return "%s.%s" % (__name__, self.name)

    def implemented_by(self) -> Any:
        return importlib.import_module(self.implementation)


def _write_item_fix(writer: writers.KnownWriter) -> Fix:
    return Fix(
        name="write_item",
        library=writer.name,
        watches=(writer.module,),
        reads="torch's _write_item signature; %s's version and its writer's own _write_item call" % writer.name,
        rebinds="%s._write_item (module global): a caller of torch's that supplies the missing arguments"
        % writer.module,
        importers=writer.importers,
    )


def _async_results_fixes(writer: writers.KnownWriter) -> Tuple[Fix, ...]:
    return (
        Fix(
            name="write_results_per_save",
            library=writer.name,
            watches=(writer.module,),
            reads="whether %s's FileSystemWriterAsync.prepare_write_data takes its results queue from a module "
            "function that keeps one queue in a module global (_results_queue)" % writer.name,
            rebinds="that function's global name in %s: a new queue on the manager it made, for each save"
            % writer.module,
            importers=writer.importers,
        ),
        Fix(
            name="results_match_files",
            library=writer.name,
            watches=(writer.module,),
            reads="whether %s's FileSystemWriterAsync.retrieve_write_results takes its results from a queue"
            % writer.name,
            rebinds="FileSystemWriterAsync.finish (on that class): each file's size is checked against where "
            "its last item ends before .metadata is written; a mismatch raises CheckpointingException",
            importers=writer.importers,
        ),
    )


def _async_failure_fixes(writer: writers.KnownWriter) -> Tuple[Fix, ...]:
    return (
        Fix(
            name="writer_processes_watched",
            library=writer.name,
            watches=(writer.module,),
            reads="whether %s's FileSystemWriterAsync.write_preloaded_data_multiproc forks its writers from the "
            "module's multiprocessing global and waits for them on a queue, and which parameter is the save's results "
            "queue" % writer.name,
            rebinds="%s's multiprocessing global (its contexts' queue waits end when a process that context started "
            "died) and write_preloaded_data_multiproc (what stopped it goes on the save's results queue)"
            % writer.module,
            importers=writer.importers,
            gate="_writer_forks_its_writers",
        ),
        Fix(
            name="async_worker_watched",
            library=writer.name,
            watches=(writer.async_module,),
            reads="which of %s's async callers run a spawned worker loop (async_loop) and make their queues from the "
            "module's multiprocessing global" % writer.name,
            rebinds="%s's multiprocessing global (waits on the worker end when it is dead), those callers' "
            "schedule_async_call / is_current_async_call_done / close (which worker the waits watch), and the "
            "worker loop (what it raised goes on comp_q)" % writer.async_module,
            importers=writer.importers,
            gate="_module_runs_a_worker_loop",
        ),
        Fix(
            name="failed_saves_raise_everywhere",
            library=writer.name,
            watches=(writer.async_module,),
            reads="%s's async callers and AsyncCallsQueue, and that their done check all-reduces through the "
            "module's torch global" % writer.name,
            rebinds="%s's torch global (the done check's all_reduce carries failures), the callers' "
            "is_current_async_call_done / schedule_async_call and AsyncCallsQueue.maybe_finalize_async_calls: "
            "every rank raises CheckpointException with every failed rank's reason, the save unfinalized"
            % writer.async_module,
            importers=writer.importers,
        ),
    )


FIXES: Tuple[Fix, ...] = (
    _write_item_fix(writers.MEGATRON_CORE),
    *_async_results_fixes(writers.MEGATRON_CORE),
    *_async_failure_fixes(writers.MEGATRON_CORE),
    Fix(
        name="keep_mcore_data",
        library="megatron-core",
        watches=(STRATEGIES_TORCH,),
        reads="whether torch's FileSystemWriter.finish rebuilds the Metadata (dataclasses.replace); which "
        "attributes megatron-core's planner and async saver store on it (mcore_data, all_local_plans)",
        rebinds="torch.distributed.checkpoint.filesystem.dataclasses (module global): replace() then also "
        "carries those attributes over to the new Metadata",
        gate="_torch_finish_may_rebuild_the_metadata",
    ),
    Fix(
        name="load_without_mcore_data",
        library="megatron-core",
        watches=(STRATEGIES_TORCH,),
        reads="whether megatron-core's get_reformulation_metadata reads Metadata.mcore_data",
        rebinds="%s.get_reformulation_metadata (module global) and TorchDistLoadShardedStrategy."
        "load_tensors_metadata: shapes recovered where provable, a clear error otherwise" % STRATEGIES_TORCH,
    ),
    Fix(
        name="tensor_properties_fields",
        library="megatron-core",
        watches=(STRATEGIES_TORCH,),
        reads="which fields of torch's TensorProperties torch.empty refuses (strides, torch 2.15+), and which "
        "functions of megatron-core build meta tensors with torch.empty(..., **properties.__dict__)",
        rebinds="%s's torch global: the real torch but for empty(), which leaves those fields out" % STRATEGIES_TORCH,
        gate="_tensor_properties_may_have_a_field_empty_refuses",
    ),
    Fix(
        name="sharded_objects_planned_once",
        library="megatron-core",
        watches=(STRATEGIES_TORCH,),
        reads="whether megatron-core's MCoreSavePlanner adds its own write requests for ShardedObjects "
        "(0.6 - 0.8), and whether torch's create_default_local_save_plan already plans them on every rank (2.4+)",
        rebinds="%s.MCoreSavePlanner._add_non_coordinator_iobytes_request: called only when the plan lacks one "
        "of the rank's objects, so each is planned once" % STRATEGIES_TORCH,
        gate="_planner_adds_its_own_requests",
    ),
    Fix(
        name="allow_shape_mismatch_on_load",
        library="megatron-core",
        watches=(STRATEGIES_TORCH,),
        reads="whether torch's create_default_local_load_plan refuses a saved size that differs from the asked "
        "one (2.6+), and whether megatron-core's MCoreLoadPlanner gets tensors saved with allow_shape_mismatch "
        "past it itself (0.12+)",
        rebinds="%s.MCoreLoadPlanner.create_local_plan: while it plans, the tensors it does not validate itself "
        "(saved with allow_shape_mismatch) give the asked size; rigid ones are still refused" % STRATEGIES_TORCH,
        gate="_planner_may_lack_a_shape_bypass",
    ),
    Fix(
        name="numpy_removed_names",
        library="megatron-core",
        watches=tuple(
            _DC + name
            for name in ("mapping", "validation", "exchange_utils", "serialization", "strategies.fully_parallel")
        ),
        reads="which numpy names each checkpointing module's code calls (np.product) and whether the installed "
        "numpy still has them (numpy 2 removed product, cumproduct, alltrue, sometrue)",
        rebinds="that module's np global: numpy itself, but for the removed names it calls, which are numpy's "
        "own replacements (numpy.prod for product)",
        gate="_numpy_lacks_a_removed_name",
    ),
    Fix(
        name="torch_load_weights_only",
        library="megatron-core",
        watches=(_DC + "strategies.common", _DC + "serialization"),
        reads="which functions read checkpoint files with torch.load and no weights_only (0.6 - 0.10, 0.14+: "
        "common.pt, sharded objects; never whether an allowlist's module is imported yet); torch's default for "
        "weights_only",
        rebinds="that module's torch global: torch itself, but load() passes weights_only=False when a call "
        "passes none, as on the torch those releases were written for",
        gate="_megatron_may_load_without_weights_only",
    ),
    Fix(
        name="pkg_resources_packaging",
        library="megatron-core",
        watches=(
            "megatron.core.tensor_parallel.random",
            STRATEGIES_TORCH,
            "megatron.core.transformer.attention",
            "megatron.core.transformer.custom_layers.transformer_engine",
            "megatron.core.transformer.moe.grouped_gemm_util",
            "megatron.core.models.retro.config",
        ),
        reads="whether the module imports pkg_resources while its body runs, and whether the installed "
        "setuptools provides it with packaging (read from pkg_resources' code, never imported)",
        rebinds="nothing afterwards: while that module's body runs, its `from pkg_resources import packaging` "
        "gets the installed packaging, and nothing else sees a pkg_resources",
        gate="_pkg_resources_may_lack_packaging",
        acts_while_executing=True,
    ),
    _write_item_fix(writers.NVIDIA_RESILIENCY_EXT),
    *_async_results_fixes(writers.NVIDIA_RESILIENCY_EXT),
    *_async_failure_fixes(writers.NVIDIA_RESILIENCY_EXT),
)


# --- gates: what rules a fix out without importing it -------------------------------------------

# numpy 2 removed these aliases (numpy_removed_names.REPLACEMENTS says of what; a test checks they agree).
REMOVED_BY_NUMPY_2 = ("product", "cumproduct", "alltrue", "sometrue")


def _numpy_lacks_a_removed_name(module: ModuleType) -> Optional[str]:
    numpy = sys.modules.get("numpy")
    if numpy is not None and all(hasattr(numpy, name) for name in REMOVED_BY_NUMPY_2):
        return "numpy %s has every name numpy 2 removed" % getattr(numpy, "__version__", "?")
    # "product" is in "cumproduct" too.
    if not _source_may_name(module, b"product", b"alltrue", b"sometrue"):
        return "megatron-core's source here never names what numpy 2 removed"
    return None


# torch's module whose FileSystemWriter.finish the keep_mcore_data fix reads (and whose
# ``dataclasses`` global it rebinds); keep_mcore_data.TORCH_FS_MODULE (a test checks they agree).
TORCH_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


def _torch_finish_may_rebuild_the_metadata(module: ModuleType) -> Optional[str]:
    finish = getattr(getattr(sys.modules.get(TORCH_FILESYSTEM), "FileSystemWriter", None), "finish", None)
    if finish is None:
        return None  # the fix says what it cannot read
    from mcore_autopatch.shared import code_reading

    names: "set[str]" = set()
    for code in code_reading.codes_of(finish):
        names.update(code.co_names)
    if not names or "replace" in names or "Metadata" in names:
        return None
    torch = getattr(sys.modules.get("torch"), "__version__", "(unknown version)")
    return "torch %s's FileSystemWriter.finish updates the Metadata in place: what megatron-core sets on it is kept" % (
        torch
    )


def _writer_forks_its_writers(module: ModuleType) -> Optional[str]:
    writer = vars(module).get("FileSystemWriterAsync")
    if isinstance(writer, type) and "write_preloaded_data_multiproc" not in vars(writer):
        return "its FileSystemWriterAsync writes from threads (no write_preloaded_data_multiproc): none dies alone"
    return None


def _module_runs_a_worker_loop(module: ModuleType) -> Optional[str]:
    for value in vars(module).values():
        if isinstance(value, type) and any(
            name.startswith("async_loop") and isinstance(member, staticmethod) for name, member in vars(value).items()
        ):
            return None
    return "no persistent checkpoint worker here (one process per save, watched by failed_saves_raise_everywhere)"


# The keywords torch.empty takes that TensorProperties held through torch 2.14; a field beyond
# them (strides, 2.15) is tried by the fix itself.
EMPTY_TAKES = frozenset(("dtype", "layout", "requires_grad", "memory_format", "pin_memory"))


def _tensor_properties_may_have_a_field_empty_refuses(module: ModuleType) -> Optional[str]:
    properties = getattr(sys.modules.get("torch.distributed.checkpoint.metadata"), "TensorProperties", None)
    fields = getattr(properties, "__dataclass_fields__", None)
    if isinstance(fields, dict) and set(fields) <= EMPTY_TAKES:
        torch = getattr(sys.modules.get("torch"), "__version__", "(unknown version)")
        return "torch.empty takes every field of torch %s's TensorProperties" % torch
    return None


def _planner_adds_its_own_requests(module: ModuleType) -> Optional[str]:
    planner = vars(module).get("MCoreSavePlanner")
    if isinstance(planner, type) and "_add_non_coordinator_iobytes_request" in vars(planner):
        return None
    return "megatron-core plans its ShardedObjects itself"


def _planner_may_lack_a_shape_bypass(module: ModuleType) -> Optional[str]:
    planner = vars(module).get("MCoreLoadPlanner")
    if isinstance(planner, type) and "_temporarily_bypass_shape_validation" in vars(planner):
        return "megatron-core lets tensors saved with allow_shape_mismatch past torch's size check itself"
    return None


def _megatron_may_load_without_weights_only(module: ModuleType) -> Optional[str]:
    torch = sys.modules.get("torch")
    # The globals a torch.load can go through: torch itself, or a stand-in of it (ours, from
    # an earlier execution; told by its class name, so that standin is not imported here).
    owners = {name for name, value in vars(module).items() if value is torch or type(value).__name__ == "ModuleStandIn"}
    if torch is None or not owners:
        return "megatron-core's code here does not hold torch"
    from mcore_autopatch.shared import code_reading

    # 0.11 - 0.13 name weights_only in every function that loads: no bytecode needs reading then.
    for _name, code in code_reading.defined_functions(module):
        names = code_reading.mentions(code)
        if "load" in names and "weights_only" not in names and not owners.isdisjoint(names):
            return None
    return "megatron-core passes weights_only wherever its code here calls torch's load"


def _pkg_resources_may_lack_packaging(module: ModuleType) -> Optional[str]:
    loaded = sys.modules.get("pkg_resources")
    if loaded is not None and hasattr(loaded, "packaging"):
        return "the pkg_resources imported here provides packaging"
    if not _source_may_name(module, b"pkg_resources"):
        return "megatron-core's source here never names pkg_resources"
    return None


def _source_may_name(module: ModuleType, *words: bytes) -> bool:
    """False only when ``module``'s source file can be read and contains none of ``words``.

    A necessary condition, cheaper than reading the code: a plain read of the file costs
    less than importing the fix that would read its code objects, and it works before the
    body runs, when there are none. A module without a ``.py`` file (sourceless, zipped,
    built in) may name anything."""
    path = getattr(getattr(module, "__spec__", None), "origin", None)
    if not isinstance(path, str) or not path.endswith(".py"):
        return True
    try:
        with open(path, "rb") as source:
            text = source.read()
    except OSError:
        return True
    return any(word in text for word in words)


def ruled_out(fix: "Fix", module: ModuleType) -> Optional[str]:
    """Why ``fix`` is not needed for ``module``, when its gate can tell; else None."""
    return globals()[fix.gate](module) if fix.gate else None


def watched_modules() -> "set[str]":
    """Every module whose execution the startup finder must report here."""
    return {name for f in FIXES for name in f.watches} | {name for f in FIXES for name in f.importers}


def fixes_for(library: str) -> Tuple[Fix, ...]:
    return tuple(f for f in FIXES if f.library == library)


def by_name(name: str, library: str = "megatron-core") -> Fix:
    return next(f for f in FIXES if f.name == name and f.library == library)


def skipped_names(environ: "Optional[Dict[str, str]]" = None) -> "set[str]":
    """The fix names ``MCORE_AUTOPATCH_SKIP`` lists (comma or space separated)."""
    raw = (os.environ if environ is None else environ).get(SKIP_ENV, "")
    return {word for word in raw.replace(",", " ").split() if word}


def is_skipped(fix: Fix) -> bool:
    return fix.name in skipped_names()


# --- what the hook decided, per fix and module --------------------------------------------------

_seen: "weakref.WeakSet[ModuleType]" = weakref.WeakSet()  # watched modules already handled


def _fresh_state() -> Dict[str, Any]:
    # logged: (fix, module) pairs whose first decision was logged; warned: reasons warned
    # about; last: what the hook decided when each fix last ran, by Fix.key, then module.
    return {"logged": set(), "mode_warned": False, "skip_warned": False, "warned": set(), "last": {}}


_state = _fresh_state()


def combine(rows: "List[Dict[str, Any]]") -> Optional[Dict[str, Any]]:
    """One answer from the answers for several modules of one fix: needed when one needs it
    (cannot tell when one cannot and none needs it), applied when every module that needs it
    has it, the reasons of the modules that decide it."""
    if not rows:
        return None
    needed_rows = [r for r in rows if r["needed"]]
    unknown_rows = [r for r in rows if r["needed"] is None]
    deciding = needed_rows or unknown_rows or rows
    needed: Optional[bool] = True if needed_rows else (None if unknown_rows else False)
    applied = all(r["applied"] for r in needed_rows) if needed_rows else any(r["applied"] for r in rows)
    places: Dict[str, List[str]] = {}
    for row in deciding:
        places.setdefault(row["reason"], [])
        if row.get("where"):
            places[row["reason"]].append(row["where"])
    reasons = ["%s (in %s)" % (reason, "; ".join(where)) if where else reason for reason, where in places.items()]
    return {"needed": needed, "applied": applied, "reason": "; ".join(reasons)}


def last_decision(fix: Fix) -> Optional[Dict[str, Any]]:
    """What the hook decided when ``fix`` last ran in this process, over its modules, or None."""
    per_module = _state["last"].get(fix.key)
    return combine([dict(per_module[name]) for name in fix.watches if name in per_module]) if per_module else None


def run(fix: Fix, module: ModuleType, mode: str) -> None:
    """Apply ``fix`` to its just-executed ``module``; record and log the decision. Never raises."""
    try:
        gated = ruled_out(fix, module)
        if gated is not None:  # the implementation is not even imported
            _state["last"].setdefault(fix.key, {})[module.__name__] = {
                "needed": False,
                "applied": False,
                "reason": gated,
                "where": module.__name__[len("megatron.core.") :],
            }
            return
        implementation = fix.implemented_by()
        if is_skipped(fix):
            decision = implementation.evaluate(module, mode).decision
            applied = False
            decision = decision._replace(reason="%s; skipped: %s names it" % (decision.reason, SKIP_ENV))
        else:
            decision, applied = implementation.apply(module, mode)
        row = {"needed": decision.needed, "applied": applied, "reason": decision.reason, "where": decision.where}
        _state["last"].setdefault(fix.key, {})[module.__name__] = row
        _log(fix, module.__name__, decision, applied)
    except Exception:
        logger.warning("%s: checking %s failed; it is left unchanged", fix.key, module.__name__, exc_info=True)


def _mode() -> str:
    mode, recognised = mcore_autopatch.read_mode()
    if not recognised and not _state["mode_warned"]:
        _state["mode_warned"] = True
        logger.warning("MCORE_AUTOPATCH has an unknown value; behaving as 'auto' (use auto, 0, off or force)")
    unknown = skipped_names() - {f.name for f in FIXES}
    if unknown and not _state["skip_warned"]:
        _state["skip_warned"] = True
        logger.warning(
            "%s names no fix: %s (the fixes are %s)",
            SKIP_ENV,
            ", ".join(sorted(unknown)),
            ", ".join(dict.fromkeys(f.name for f in FIXES)),
        )
    return mode


def before_module_executes(module: ModuleType) -> Optional[Callable[[], None]]:
    """importhook callback: a watched module's body is about to run. Returns what to call
    once it has run (the fixes that act during the body), or None."""
    try:
        mode = _mode()
        if mode == "off":
            return None
        cleanups = []
        for fix in FIXES:
            if fix.acts_while_executing and module.__name__ in fix.watches and not is_skipped(fix):
                if ruled_out(fix, module) is None:
                    cleanup = fix.implemented_by().before(module, mode)
                    if cleanup is not None:
                        cleanups.append(cleanup)
    except Exception:
        logger.warning("preparing %s failed; it is left unchanged", getattr(module, "__name__", module), exc_info=True)
        return None
    if not cleanups:
        return None

    def after_body() -> None:
        for cleanup in reversed(cleanups):
            cleanup()

    return after_body


def on_module_executed(module: ModuleType) -> None:
    """importhook callback: a watched module's body has just executed."""
    try:
        mode = _mode()
        if mode == "off":
            return
        name = module.__name__
        _seen.add(module)
        for fix in FIXES:
            if name in fix.watches:
                run(fix, module, mode)
        # Modules this one imports at its top that were loaded without our finder (a finder
        # ahead of ours): every fix that watches them runs now, with one warning per module.
        missed = {}
        for fix in FIXES:
            if name in fix.importers:
                for watched_name in fix.watches:
                    watched = sys.modules.get(watched_name)
                    if watched is not None and watched not in _seen:
                        missed[watched_name] = watched
        for watched_name, watched in missed.items():
            loader = getattr(getattr(watched, "__spec__", None), "loader", None)
            logger.warning(
                "%s was loaded without mcore_autopatch's finder (by %r); checking it now", watched_name, loader
            )
            _seen.add(watched)
            for fix in FIXES:
                if watched_name in fix.watches:
                    run(fix, watched, mode)
    except Exception:
        logger.warning("checking %s failed; it is left unchanged", getattr(module, "__name__", module), exc_info=True)


def _log(fix: Fix, module: str, decision: Any, applied: bool) -> None:
    first = (fix.key, module) not in _state["logged"]
    _state["logged"].add((fix.key, module))
    if decision.needed is not False and not applied:
        if decision.reason not in _state["warned"]:  # once per process per reason
            _state["warned"].add(decision.reason)
            logger.warning(
                "%s: fix %s but not applied: %s",
                fix.key,
                "needed" if decision.needed else "maybe needed",
                decision.reason,
            )
    elif first and applied:  # once per fix and module; what needs nothing is for debug logs
        where = " (%s)" % decision.where if decision.where else ""
        logger.info("%s: applied%s: %s", fix.key, where, decision.reason)
    else:
        logger.debug(
            "%s: %s%s: %s",
            fix.key,
            "applied" if applied else "not applied",
            " (%s)" % decision.where if decision.where else "",
            decision.reason,
        )
