"""numpy names that numpy 2 removed, given back to the megatron-core modules that still call them.

numpy 2.0 removed ``product``, ``cumproduct``, ``alltrue`` and ``sometrue``, the deprecated
aliases of ``prod``, ``cumprod``, ``all`` and ``any``. megatron-core 0.6 - 0.15 call
``np.product`` on the checkpoint path: ``_validate_sharding_for_key_flattened``
(validation.py; serialization.py in 0.6/0.7) on global rank 0 for every save and load with
flattened (distributed-optimizer) shards, so rank 0 raises and the other ranks wait in the
next collective until the process-group timeout; ``_shard_size`` (exchange_utils.py;
strategies/fully_parallel.py in 0.7/0.8) in every fully parallel save or load over more than
one rank; ``ShardedTensor.local_coordinates`` (mapping.py). 0.6 - 0.12 declare no numpy
bound, so a fresh install next to torch gets numpy 2.

What is read, per watched module: the numpy module's globals in it (``np``), which of the
removed names its functions load from them (bytecode: ``np.product``), and whether the
installed numpy still has them. What is rebound, only when a called name is missing: that
module's numpy global, to a stand-in that is the real numpy for every name but the missing
ones, which are numpy's own replacement function (``numpy.prod`` for ``product``). numpy
itself, and every other module's view of it, are left as they are.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Dict, FrozenSet, Optional, Tuple

from mcore_autopatch.shared import code_reading, standin, versions
from mcore_autopatch.shared.values import Decision

# Removed in numpy 2.0 -> what numpy 1.x documented them as aliases of.
REPLACEMENTS: Dict[str, str] = {"product": "prod", "cumproduct": "cumprod", "alltrue": "all", "sometrue": "any"}


class Evaluation:
    __slots__ = ("callers", "decision", "missing", "numpy", "owners")

    def __init__(
        self,
        decision: Decision,
        numpy: Optional[ModuleType] = None,
        owners: FrozenSet[str] = frozenset(),  # the module's globals bound to numpy
        missing: Tuple[str, ...] = (),  # removed names the module calls (sorted)
        callers: Tuple[str, ...] = (),  # the functions that call them
    ) -> None:
        self.decision = decision
        self.numpy = numpy
        self.owners = owners
        self.missing = missing
        self.callers = callers


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    where = code_reading.short_name(module.__name__)
    megatron = versions.megatron_core_label()
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return Evaluation(Decision(False, "%s: numpy is not imported" % megatron, where=where))
    owners = code_reading.globals_bound_to(module, numpy, standin.real_module)
    gone = frozenset(name for name in REPLACEMENTS if not hasattr(numpy, name))
    version = getattr(numpy, "__version__", "?")
    if not owners or not gone:
        why = "no numpy global" if not owners else "numpy %s has every name its checkpointing code calls" % version
        return Evaluation(Decision(False, "%s: %s" % (megatron, why), where=where), numpy, owners)
    missing: "set[str]" = set()
    callers = []
    for qualname, code in code_reading.defined_functions(module):
        called = code_reading.attributes_loaded(code, owners, gone)
        if called:
            missing |= called
            callers.append(qualname)
    if not missing:
        reason = "%s calls none of the names numpy %s removed" % (megatron, version)
        return Evaluation(Decision(False, reason, where=where), numpy, owners)
    names = sorted(missing)
    where = "%s: %s" % (where, ", ".join(callers))
    unavailable = [n for n in names if not callable(getattr(numpy, REPLACEMENTS[n], None))]
    called = ", ".join("numpy.%s" % n for n in names)
    if unavailable:
        reason = "%s calls %s, and numpy %s has no %s either; not patching" % (
            megatron,
            called,
            version,
            ", ".join(REPLACEMENTS[n] for n in unavailable),
        )
        return Evaluation(Decision(None, reason, where=where), numpy, owners, tuple(names), tuple(callers))
    reason = "%s calls %s, which numpy %s no longer has: the numpy global of each module that calls it gives %s" % (
        megatron,
        called,
        version,
        ", ".join("numpy.%s under the name %s" % (REPLACEMENTS[n], n) for n in names),
    )
    return Evaluation(Decision(True, reason, where=where), numpy, owners, tuple(names), tuple(callers))


def is_applied(module: ModuleType) -> bool:
    return any(set(standin.overrides(value)) & set(REPLACEMENTS) for value in vars(module).values())


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.numpy is None:
        return ev.decision, is_applied(module)
    numpy = ev.numpy
    namespace = vars(module)
    overrides = {name: getattr(numpy, REPLACEMENTS[name]) for name in ev.missing}
    why = ", ".join("%s is numpy.%s" % (name, REPLACEMENTS[name]) for name in ev.missing)
    for owner in sorted(ev.owners):
        if set(ev.missing) <= set(standin.overrides(namespace.get(owner))):
            continue  # already given (a re-import, or a second look)
        refused = standin.rebind(namespace, owner, numpy, overrides, why)
        if refused:
            return Decision(
                True, "%s; but %s.%s, so it is left alone" % (ev.decision.reason, module.__name__, refused)
            ), False
    return ev.decision, True
