"""megatron-core's own reads of its checkpoint files, as they were on the torch they were written for.

torch 2.6 made ``weights_only=True`` the default of ``torch.load``. megatron-core 0.6 - 0.10
read the checkpoint's ``common.pt`` (and the files of sharded objects) with a bare
``torch.load`` (serialization.py in 0.6/0.7, strategies/common.py in 0.8 - 0.10); Megatron-LM
keeps ``args``, an ``argparse.Namespace``, in ``common.pt``, so every resume fails with
``UnpicklingError: Weights only load failed ... argparse.Namespace``. 0.11 - 0.13 and 0.17.0
pass ``weights_only=False`` themselves. 0.14 - 0.16, 0.17.1 and later pass nothing again and
register an allowlist with torch at ``import megatron.core`` (``megatron.core.safe_globals``):
it admits what Megatron-LM itself keeps in ``args``, and refuses the types of checkpoints
saved by earlier releases (Megatron-LM #1884) and what frameworks add to ``args`` (slime
#686). They are treated like 0.6 - 0.10, deliberately: the decision is read from the code
that loads, never from whether the allowlist's module happens to be imported yet, so
``status`` and the hook say the same thing in any import order.

What the call loads is what those releases loaded on the torch they were written for, where
``weights_only`` defaulted to False: the whole pickle. That adds no trust a torch_dist
checkpoint does not already need: torch's own reader unpickles the same folder's
``.metadata`` with ``pickle.load`` and every sharded object with ``torch.load(...,
weights_only=False)`` (docs/how-it-works.md). ``MCORE_AUTOPATCH_SKIP=torch_load_weights_only``
keeps torch's default instead.

What is read: which functions of the watched module load ``torch.load`` and never name
``weights_only`` (bytecode), whether megatron-core registered its own allowlist, and what
torch's ``load`` does with a call that passes no ``weights_only`` (torch's own
``_default_to_weights_only``, and its ``TORCH_FORCE_*WEIGHTS_ONLY_LOAD`` variables). What is
rebound, only when such a call would load with ``weights_only=True``: that module's ``torch``
global, to a stand-in that is the real torch for every name but ``load``, which passes
``weights_only=False`` when a call passes none. ``torch.load`` itself is unchanged for every
other caller.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any, Callable, Optional, Tuple

from mcore_autopatch.shared import code_reading, standin, versions
from mcore_autopatch.shared.values import Decision

NAME = "torch_load_weights_only"
OWN_ALLOWLIST_MODULE = "megatron.core.safe_globals"  # megatron-core 0.14+: its own choice
_TRUE = ("1", "y", "yes", "true")
MARK = "__mcore_autopatch__"


class Evaluation:
    __slots__ = ("callers", "decision", "owners", "torch")

    def __init__(
        self,
        decision: Decision,
        torch: Optional[ModuleType] = None,
        owners: Tuple[str, ...] = (),
        callers: Tuple[str, ...] = (),
    ) -> None:
        self.decision = decision
        self.torch = torch
        self.owners = owners
        self.callers = callers


def torch_default(torch: ModuleType) -> "tuple[Optional[bool], str]":
    """What torch's ``load`` uses for ``weights_only`` when a call passes none, and why."""
    forced = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    unforced = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    if forced:
        return True, "TORCH_FORCE_WEIGHTS_ONLY_LOAD is set"
    if unforced:
        return False, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set"
    default = getattr(getattr(torch, "serialization", None), "_default_to_weights_only", None)
    if default is None:
        return False, "torch %s loads the whole pickle unless told otherwise" % getattr(torch, "__version__", "?")
    try:
        return bool(default(None)), "torch %s loads with weights_only=%s unless told otherwise" % (
            torch.__version__,
            bool(default(None)),
        )
    except Exception as exc:
        return None, "torch's default for weights_only cannot be read (%s)" % exc


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    where = code_reading.short_name(module.__name__)
    megatron = versions.megatron_core_label()
    torch = sys.modules.get("torch")
    if torch is None:
        return Evaluation(Decision(False, "%s: torch is not imported" % megatron, where=where))
    owners = code_reading.globals_bound_to(module, torch, standin.real_module)
    callers = tuple(
        qualname
        for qualname, code in code_reading.defined_functions(module)
        # The cheap test first: a release that passes weights_only names it in every
        # function that loads, and then no bytecode needs reading (0.11+).
        if "weights_only" not in code_reading.mentions(code)
        and code_reading.attributes_loaded(code, owners, frozenset(("load",)))
    )
    if not callers:
        reason = "%s passes weights_only to every torch.load of its checkpointing code" % megatron
        return Evaluation(Decision(False, reason, where=where))
    where = "%s: %s" % (where, ", ".join(callers))
    reads = "%s reads checkpoint files with torch.load and no weights_only" % megatron
    if has_own_allowlist():
        reads += (
            " (its own allowlist, %s, admits Megatron-LM's args but not the types of earlier releases' checkpoints "
            "or of frameworks' args)" % OWN_ALLOWLIST_MODULE
        )
    default, why = torch_default(torch)
    if default is None:
        return Evaluation(Decision(None, "%s; %s; not patching" % (reads, why), where=where))
    if not default:
        return Evaluation(Decision(False, "%s; %s, as that release expects" % (reads, why), where=where))
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        reason = "%s; TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, which torch applies whatever a call passes: not patching"
        return Evaluation(Decision(None, reason % reads, where=where))
    reason = (
        "%s; %s, which refuses the argparse.Namespace Megatron-LM keeps in common.pt: the torch.load of each module "
        "that reads them passes weights_only=False when a call passes none, as on the torch that release was "
        "written for" % (reads, why)
    )
    return Evaluation(Decision(True, reason, where=where), torch, tuple(sorted(owners)), callers)


def has_own_allowlist() -> bool:
    """Whether the megatron-core imported here ships an allowlist it registers at import (0.14+),
    read from its package's files: the same answer before and after that module is imported."""
    if OWN_ALLOWLIST_MODULE in sys.modules:
        return True
    package = sys.modules.get("megatron.core")
    folders = getattr(package, "__path__", None) or ()
    return any(os.path.isfile(os.path.join(folder, "safe_globals.py")) for folder in folders)


def loading_whole_pickle_by_default(real_load: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.load`` with ``weights_only=False`` when the caller passes none."""

    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("weights_only", False)
        return real_load(*args, **kwargs)

    load.__wrapped__ = real_load  # type: ignore[attr-defined]
    load.__doc__ = getattr(real_load, "__doc__", None)
    setattr(load, MARK, True)
    return load


def is_applied(module: ModuleType) -> bool:
    return any("load" in standin.overrides(value) for value in vars(module).values())


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.torch is None:
        return ev.decision, is_applied(module)
    why = "load() defaults to weights_only=False"
    refused = standin.override_each(
        vars(module), ev.owners, "load", lambda torch: loading_whole_pickle_by_default(torch.load), why, real=ev.torch
    )
    if refused:
        reason = "%s; but %s.%s, so it is left alone" % (ev.decision.reason, module.__name__, refused)
        return Decision(True, reason), False
    return ev.decision, True
