"""Meta tensors built from a checkpoint's ``TensorProperties`` on a torch that added fields to it.

Every megatron-core from 0.6 to 0.19 describes the tensors of a checkpoint without reading
them, in ``TorchDistLoadShardedStrategy.load_tensors_metadata`` (strategies/torch.py):
``torch.empty(tp.size, **tp.properties.__dict__, device='meta')``, i.e. every field of torch's
``TensorProperties`` passed to ``torch.empty`` as a keyword. torch 2.15 added a field,
``strides``, that ``torch.empty`` does not take: ``TypeError: empty() got an unexpected
keyword argument 'strides'``. That breaks ``dist_checkpointing.load_tensors_metadata``,
``load_sharded_metadata``, every ``load`` whose strictness checks the checkpoint's keys
(Megatron-LM's ``--dist-ckpt-strictness`` other than ``assume_ok_unexpected``) and every tool
that reads a checkpoint's shapes. No upstream release has a fix.

What is read: the fields of the installed torch's ``TensorProperties``, which of them
``torch.empty`` refuses (each tried on the meta device, which allocates nothing), and which
functions of the watched module load ``<torch>.empty`` and mention ``properties`` and
``__dict__`` (bytecode). What is rebound, only when such a function exists and a field is
refused: that module's ``torch`` global, to a stand-in that is the real torch for every name
but ``empty``, which leaves out the refused fields' keywords, as on the torch that release
was written for. A meta tensor has no storage, so its strides describe nothing that
megatron-core reads; ``torch.empty`` itself, and what a checkpoint holds, are unchanged.
"""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType
from typing import Any, Callable, FrozenSet, Optional, Tuple

from mcore_autopatch.shared import code_reading, standin, versions
from mcore_autopatch.shared.values import Decision

TORCH_METADATA = "torch.distributed.checkpoint.metadata"
MARK = "__mcore_autopatch__"
# What megatron-core's call reads from a TensorProperties: ``tp.properties.__dict__``.
_CALL_NAMES = frozenset(("properties", "__dict__"))


class Evaluation:
    __slots__ = ("decision", "owners", "refused", "torch")

    def __init__(
        self,
        decision: Decision,
        torch: Optional[ModuleType] = None,
        owners: FrozenSet[str] = frozenset(),
        refused: Tuple[str, ...] = (),
    ) -> None:
        self.decision = decision
        self.torch = torch
        self.owners = owners
        self.refused = refused


def fields_empty_refuses(torch: ModuleType) -> "tuple[Tuple[str, ...], Tuple[str, ...]]":
    """(every field of torch's TensorProperties, those ``torch.empty`` refuses as a keyword)."""
    properties = getattr(sys.modules.get(TORCH_METADATA), "TensorProperties", None)
    if properties is None or not dataclasses.is_dataclass(properties):
        return (), ()
    names = tuple(f.name for f in dataclasses.fields(properties))
    try:
        made = properties()
    except Exception:  # a field without a default: each is tried with None
        made = None
    defaults = {name: getattr(made, name, None) for name in names}
    refused = []
    for name in names:
        try:
            torch.empty((0,), device="meta", **{name: defaults.get(name)})
        except TypeError as exc:
            if name in str(exc):
                refused.append(name)
    return names, tuple(refused)


def callers(module: ModuleType, owners: FrozenSet[str]) -> Tuple[str, ...]:
    """The functions of ``module`` that call ``<torch>.empty`` with ``<x>.properties.__dict__``."""
    return tuple(
        qualname
        for qualname, code in code_reading.defined_functions(module)
        if _CALL_NAMES <= code_reading.mentions(code)
        and code_reading.attributes_loaded(code, owners, frozenset(("empty",)))
    )


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    where = code_reading.short_name(module.__name__)
    megatron = versions.megatron_core_label()
    torch = sys.modules.get("torch")
    if torch is None:
        return Evaluation(Decision(False, "%s: torch is not imported" % megatron, where=where))
    torch_label = "torch %s" % versions.torch_version()
    names, refused = fields_empty_refuses(torch)
    if not names:
        reason = "%s has no TensorProperties dataclass to read; not patching" % torch_label
        return Evaluation(Decision(None, reason, where=where))
    if not refused:
        reason = "torch.empty takes every field of %s's TensorProperties (%s)" % (torch_label, ", ".join(names))
        return Evaluation(Decision(False, reason, where=where))
    owners = code_reading.globals_bound_to(module, torch, standin.real_module)
    found = callers(module, owners)
    fields = ", ".join(refused)
    if not found:
        reason = "%s's code here never passes a TensorProperties' fields to torch.empty" % megatron
        return Evaluation(Decision(False, reason, where=where))
    reason = (
        "%s builds meta tensors with torch.empty(..., **TensorProperties.__dict__); %s's TensorProperties has "
        "%s, which torch.empty refuses: that module's torch.empty leaves %s out, as on the torch that release "
        "was written for" % (megatron, torch_label, fields, "it" if len(refused) == 1 else "them")
    )
    return Evaluation(Decision(True, reason, where="%s: %s" % (where, ", ".join(found))), torch, owners, refused)


def leaving_out(real_empty: Callable[..., Any], refused: Tuple[str, ...]) -> Callable[..., Any]:
    """``torch.empty`` without the keywords it refuses."""

    def empty(*args: Any, **kwargs: Any) -> Any:
        for name in refused:
            kwargs.pop(name, None)
        return real_empty(*args, **kwargs)

    empty.__wrapped__ = real_empty  # type: ignore[attr-defined]
    empty.__doc__ = getattr(real_empty, "__doc__", None)
    setattr(empty, MARK, refused)
    return empty


def is_applied(module: ModuleType) -> bool:
    return any("empty" in standin.overrides(value) for value in vars(module).values())


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.torch is None:
        return ev.decision, is_applied(module)
    why = "empty() leaves out %s" % ", ".join(ev.refused)
    refused = standin.override_each(
        vars(module), ev.owners, "empty", lambda torch: leaving_out(torch.empty, ev.refused), why, real=ev.torch
    )
    if refused:
        reason = "%s; but %s.%s, so it is left alone" % (ev.decision.reason, module.__name__, refused)
        return Decision(True, reason, where=ev.decision.where), False
    return ev.decision, True
