"""Keep megatron-core's own attributes on the checkpoint ``Metadata`` through torch's ``finish``.

megatron-core 0.8-0.14 put ``mcore_data`` (the original shape of every N-D flattened
tensor, i.e. the distributed optimizer's state) and, from 0.11, ``all_local_plans`` (what a
resumed job needs to reuse the metadata) on torch's ``Metadata`` as plain attributes: they
are not dataclass fields. torch 2.9.0-2.11.x start ``FileSystemWriter.finish`` with
``metadata = dataclasses.replace(metadata, version=...)``, which builds a new ``Metadata``
from the declared fields only, so both are missing from the pickled ``.metadata`` and a job
with the distributed optimizer cannot resume. torch <= 2.8 and >= 2.12 set the version in
place and keep them.

What is read (never assumed from version numbers):

* torch: whether ``FileSystemWriter.finish`` (as megatron's writer inherits it) rebuilds the
  Metadata through ``dataclasses.replace``, read from its code;
* megatron-core: which attributes its planner and its async saver store on the Metadata
  (``STORE_ATTR`` instructions of ``MCoreSavePlanner.create_global_plan`` and of the
  functions of ``state_dict_saver``, read from their bytecode), less those torch's
  ``Metadata`` declares.

What is rebound, only when both say so: the ``dataclasses`` global of torch's filesystem
module, to a stand-in whose ``replace`` calls the real one and then copies exactly those
attributes from the old ``Metadata`` to the new one; everything else is the real
``dataclasses`` module. The pickle then holds what torch 2.8 writes: torch's own
``Metadata`` with the attributes, no class of ours.
"""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

from mcore_autopatch.shared import code_reading, versions
from mcore_autopatch.shared.values import Decision

TORCH_FS_MODULE = "torch.distributed.checkpoint.filesystem"
TORCH_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
SAVER_MODULE = "megatron.core.dist_checkpointing.strategies.state_dict_saver"
# The attributes megatron-core is known to set on torch's Metadata; the reading below
# decides which of them the installed release really sets.
KNOWN_ATTRIBUTES = ("mcore_data", "all_local_plans")
MARK = "__mcore_autopatch__"


class FinishReading:
    """How torch's ``FileSystemWriter.finish`` treats the Metadata it is given."""

    __slots__ = ("drops", "namespace", "target", "text")

    def __init__(
        self,
        drops: Optional[bool],  # None: cannot tell
        text: str,
        target: Optional[str] = None,  # the global of finish's module to rebind
        namespace: Optional[Dict[str, Any]] = None,  # that module's globals (finish.__globals__)
    ) -> None:
        self.drops = drops
        self.text = text
        self.target = target
        self.namespace = namespace


def unwrap(function: Any) -> Any:
    for _ in range(8):
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            break
        function = inner
    return getattr(function, "__func__", function)


def read_finish(fs: ModuleType) -> FinishReading:
    """Read ``FileSystemWriter.finish`` of torch's filesystem module ``fs``."""
    writer = getattr(fs, "FileSystemWriter", None)
    finish = unwrap(getattr(writer, "finish", None))
    code = getattr(finish, "__code__", None)
    if code is None:
        return FinishReading(None, "torch's FileSystemWriter.finish cannot be read")
    names = set(code.co_names)
    where = "FileSystemWriter.finish (%s)" % getattr(finish, "__qualname__", "finish")
    if "replace" in names:
        module_globals = getattr(finish, "__globals__", {})
        if "dataclasses" in names and _is_dataclasses(module_globals.get("dataclasses")):
            return FinishReading(
                True,
                "%s rebuilds the Metadata with dataclasses.replace" % where,
                target="dataclasses",
                namespace=module_globals,
            )
        return FinishReading(None, "%s calls a replace() mcore-autopatch does not know" % where)
    if "Metadata" in names:
        return FinishReading(None, "%s builds a new Metadata in a way mcore-autopatch does not know" % where)
    return FinishReading(False, "%s updates the Metadata in place" % where)


def _is_dataclasses(obj: Any) -> bool:
    # standin is imported where a torch that rebuilds the Metadata is met (2.9 - 2.11), not at
    # every watched import.
    from mcore_autopatch.shared import standin

    return standin.real_module(obj) is dataclasses


def stored_attributes(function: Any, names: Tuple[str, ...] = KNOWN_ATTRIBUTES) -> "set[str]":
    """Which of ``names`` ``function`` (or a function nested in it) assigns as an attribute.
    Only code that mentions one of them is scanned."""
    code = getattr(unwrap(function), "__code__", None)
    stored: "set[str]" = set()
    for current in code_reading.nested(code) if code is not None else ():
        if not set(names).isdisjoint(current.co_names):
            stored |= code_reading.stored_names(current, "STORE_ATTR") & set(names)
    return stored


def megatron_attributes(strategies_torch: ModuleType, metadata_type: Optional[type]) -> Tuple[str, ...]:
    """The attributes the installed megatron-core stores on torch's Metadata without it
    declaring them, read from the planner's and the async saver's code."""
    stored: "set[str]" = set()
    planner = getattr(strategies_torch, "MCoreSavePlanner", None)
    stored |= stored_attributes(getattr(planner, "create_global_plan", None))
    saver = sys.modules.get(SAVER_MODULE)
    if saver is not None:
        for value in list(vars(saver).values()):
            if getattr(value, "__module__", None) == SAVER_MODULE and callable(value):
                stored |= stored_attributes(value)
    declared = _declared_fields(metadata_type)
    return tuple(name for name in KNOWN_ATTRIBUTES if name in stored and name not in declared)


def _declared_fields(cls: Optional[type]) -> FrozenSet[str]:
    try:
        return frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    except TypeError:
        return frozenset()


class Evaluation:
    __slots__ = ("attributes", "decision", "finish", "fs", "metadata_type")

    def __init__(
        self,
        decision: Decision,
        fs: Optional[ModuleType] = None,
        metadata_type: Optional[type] = None,
        attributes: Tuple[str, ...] = (),
        finish: Optional[FinishReading] = None,
    ) -> None:
        self.decision = decision
        self.fs = fs
        self.metadata_type = metadata_type
        self.attributes = attributes
        self.finish = finish


def evaluate(strategies_torch: ModuleType, mode: str) -> Evaluation:
    """Decide, changing nothing, for megatron-core's ``strategies.torch`` module."""
    fs = sys.modules.get(TORCH_FS_MODULE)
    metadata_module = sys.modules.get(TORCH_METADATA_MODULE)
    metadata_type = getattr(metadata_module, "Metadata", None)
    torch_label = "torch %s" % versions.torch_version()
    if fs is None or not isinstance(metadata_type, type):
        return Evaluation(Decision(None, "%s's checkpoint filesystem module is not loaded" % torch_label))
    finish = read_finish(fs)
    attributes = megatron_attributes(strategies_torch, metadata_type)
    megatron = versions.megatron_core_label()
    if not attributes:
        reason = "%s sets no attribute of its own on the checkpoint Metadata" % megatron
        return Evaluation(Decision(False, reason), fs, metadata_type, attributes, finish)
    listed = " and ".join(attributes)
    if finish.drops is None:
        reason = "%s: %s; not patching (%s sets %s on the Metadata)" % (torch_label, finish.text, megatron, listed)
        return Evaluation(Decision(None, reason), fs, metadata_type, attributes, finish)
    if not finish.drops:
        reason = "%s's %s, so %s set by %s are kept" % (torch_label, finish.text, listed, megatron)
        return Evaluation(Decision(False, reason), fs, metadata_type, attributes, finish)
    reason = "%s's %s, dropping %s that %s sets on it" % (torch_label, finish.text, listed, megatron)
    return Evaluation(Decision(True, reason), fs, metadata_type, attributes, finish)


# --- the rebinding ---------------------------------------------------------------------


def keeping_replace(real_replace: Callable[..., Any], metadata_type: type, attributes: Tuple[str, ...]) -> Any:
    """``dataclasses.replace`` that, for a torch ``Metadata``, also carries ``attributes``."""

    def replace(obj: Any, /, **changes: Any) -> Any:
        new = real_replace(obj, **changes)
        if isinstance(obj, metadata_type):
            kept = getattr(obj, "__dict__", {})
            for name in attributes:
                if name in kept and name not in vars(new):
                    setattr(new, name, kept[name])
        return new

    replace.__wrapped__ = real_replace  # type: ignore[attr-defined]
    setattr(replace, MARK, attributes)
    return replace


def is_applied(fs: Optional[ModuleType]) -> bool:
    """Whether the ``dataclasses`` global that torch's ``finish`` uses is our stand-in."""
    if fs is None:
        return False
    return bool(kept_attributes(fs))


def kept_attributes(fs: Optional[ModuleType]) -> Tuple[str, ...]:
    """What the ``replace`` of the ``dataclasses`` that torch's ``finish`` uses carries over."""
    finish = unwrap(getattr(getattr(fs, "FileSystemWriter", None), "finish", None))
    namespace = getattr(finish, "__globals__", None) or (vars(fs) if fs is not None else {})
    return tuple(getattr(getattr(namespace.get("dataclasses"), "replace", None), MARK, ()))


def apply(strategies_torch: ModuleType, mode: str) -> "tuple[Decision, bool]":
    """Decide, and rebind the ``dataclasses`` global of the module torch's ``finish`` is
    defined in (torch's filesystem module) when needed."""
    ev = evaluate(strategies_torch, mode)
    decision = ev.decision
    finish = ev.finish
    if not decision.needed or finish is None or finish.namespace is None or ev.metadata_type is None:
        return decision, is_applied(ev.fs)
    namespace = finish.namespace
    if set(ev.attributes) <= set(kept_attributes(ev.fs)):
        return decision, True
    # Another megatron-core may set more than an earlier rebinding keeps: carry both.
    attributes = tuple(dict.fromkeys(kept_attributes(ev.fs) + ev.attributes))
    replace = keeping_replace(dataclasses.replace, ev.metadata_type, attributes)
    why = "replace() keeps %s on torch's Metadata" % ", ".join(attributes)
    from mcore_autopatch.shared import standin

    refused = standin.rebind(namespace, "dataclasses", dataclasses, {"replace": replace}, why)
    if refused:
        where = namespace.get("__name__", "torch's filesystem module")
        return Decision(True, "%s; but %s.%s, so it is left alone" % (decision.reason, where, refused)), False
    return decision, True
