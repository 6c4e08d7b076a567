"""The table of fixes, and the one callback the import hook runs for all of them.

Each fix names the module whose execution triggers it, what it reads from torch's and the
library's code, what it rebinds, and the module that implements it. An implementation has
three functions, each taking the watched module:

* ``evaluate(module, mode)``: read and decide, changing nothing (``status`` uses it too);
* ``apply(module, mode)``: decide and rebind when needed; returns ``(decision, applied)``;
* ``is_applied(module)``: whether its rebinding is in place now.

A new fix is one row here, its watched module in the startup watch list of
``mcore_autopatch/__init__.py`` (a test checks the two agree), its implementation and its
tests. ``on_module_executed`` is what ``importhook`` calls; it never raises.
"""

import importlib
import sys
import weakref
from types import ModuleType
from typing import Any, Dict, NamedTuple, Optional, Tuple

import mcore_autopatch
from mcore_autopatch import writers
from mcore_autopatch._log import logger

STRATEGIES_TORCH = mcore_autopatch.IMPORTER_MODULE  # one name, in the startup watch list


class Fix(NamedTuple):
    name: str  # what it fixes, as status and logs name it
    library: str  # the distribution whose module is watched, as users know it
    watches: str  # the module whose execution triggers it
    reads: str
    rebinds: str
    implementation: str  # module with evaluate / apply / is_applied
    # Modules that import ``watches`` at their top: when one executes and ``watches`` was
    # loaded without our finder (a finder ahead of ours), the fix is applied then.
    importers: Tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return "%s %s" % (self.library, self.name)

    def implemented_by(self) -> Any:
        return importlib.import_module(self.implementation)


def _write_item_fix(writer: writers.KnownWriter) -> Fix:
    return Fix(
        name="write_item",
        library=writer.name,
        watches=writer.module,
        reads="torch's _write_item signature; %s's version and its writer's own _write_item call" % writer.name,
        rebinds="%s._write_item (module global): a caller of torch's that supplies the missing arguments"
        % writer.module,
        implementation="mcore_autopatch.writer_fix",
        importers=writer.importers,
    )


FIXES: Tuple[Fix, ...] = (
    _write_item_fix(writers.MEGATRON_CORE),
    Fix(
        name="keep_mcore_data",
        library="megatron-core",
        watches=STRATEGIES_TORCH,
        reads="whether torch's FileSystemWriter.finish rebuilds the Metadata (dataclasses.replace); which "
        "attributes megatron-core's planner and async saver store on it (mcore_data, all_local_plans)",
        rebinds="torch.distributed.checkpoint.filesystem.dataclasses (module global): replace() then also "
        "carries those attributes over to the new Metadata",
        implementation="mcore_autopatch.metadata_fix",
    ),
    Fix(
        name="load_without_mcore_data",
        library="megatron-core",
        watches=STRATEGIES_TORCH,
        reads="whether megatron-core's get_reformulation_metadata reads Metadata.mcore_data",
        rebinds="%s.get_reformulation_metadata (module global) and TorchDistLoadShardedStrategy."
        "load_tensors_metadata: shapes recovered where provable, a clear error otherwise" % STRATEGIES_TORCH,
        implementation="mcore_autopatch.load_guard",
    ),
    _write_item_fix(writers.NVIDIA_RESILIENCY_EXT),
)


def watched_modules() -> "set[str]":
    """Every module whose execution the startup finder must report here."""
    return {f.watches for f in FIXES} | {name for f in FIXES for name in f.importers}


def fixes_for(library: str) -> Tuple[Fix, ...]:
    return tuple(f for f in FIXES if f.library == library)


# --- what the hook decided, per fix --------------------------------------------------------

_seen: "weakref.WeakSet[ModuleType]" = weakref.WeakSet()  # watched modules already handled


def _fresh_state() -> Dict[str, Any]:
    # logged: fixes whose first decision was logged; warned: reasons warned about;
    # last: what the hook decided when each fix last ran, by Fix.key.
    return {"logged": set(), "mode_warned": False, "warned": set(), "last": {}}


_state = _fresh_state()


def last_decision(fix: Fix) -> Optional[Dict[str, Any]]:
    """What the hook decided when ``fix`` last ran in this process, or None."""
    last = _state["last"].get(fix.key)
    return dict(last) if last else None


def run(fix: Fix, module: ModuleType, mode: str) -> None:
    """Apply ``fix`` to its just-executed ``module``; record and log the decision. Never raises."""
    try:
        decision, applied = fix.implemented_by().apply(module, mode)
        _state["last"][fix.key] = {"needed": decision.needed, "applied": applied, "reason": decision.reason}
        _log(fix, decision, applied)
    except Exception:
        logger.warning("%s: checking %s failed; it is left unchanged", fix.key, module.__name__, exc_info=True)


def on_module_executed(module: ModuleType) -> None:
    """importhook callback: a watched module's body has just executed."""
    try:
        mode, recognised = mcore_autopatch.read_mode()
        if not recognised and not _state["mode_warned"]:
            _state["mode_warned"] = True
            logger.warning("MCORE_AUTOPATCH has an unknown value; behaving as 'auto' (use auto, 0, off or force)")
        if mode == "off":
            return
        name = module.__name__
        _seen.add(module)
        for fix in FIXES:
            if fix.watches == name:
                run(fix, module, mode)
        for fix in FIXES:
            if name not in fix.importers:
                continue
            watched = sys.modules.get(fix.watches)
            if watched is None or watched in _seen:
                continue
            loader = getattr(getattr(watched, "__spec__", None), "loader", None)
            logger.warning(
                "%s was loaded without mcore_autopatch's finder (by %r); checking it now", fix.watches, loader
            )
            _seen.add(watched)
            run(fix, watched, mode)
    except Exception:
        logger.warning("checking %s failed; it is left unchanged", getattr(module, "__name__", module), exc_info=True)


def _log(fix: Fix, decision: Any, applied: bool) -> None:
    first = fix.key not in _state["logged"]
    _state["logged"].add(fix.key)
    if decision.needed is not False and not applied:
        if decision.reason not in _state["warned"]:  # once per process per reason
            _state["warned"].add(decision.reason)
            logger.warning(
                "%s: fix %s but not applied: %s",
                fix.key,
                "needed" if decision.needed else "maybe needed",
                decision.reason,
            )
    elif first:
        logger.info("%s: %s: %s", fix.key, "applied" if applied else "not applied", decision.reason)
    else:
        logger.debug("%s: %s again (re-import): %s", fix.key, "applied" if applied else "not applied", decision.reason)
