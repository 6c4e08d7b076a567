"""Loading checkpoints that lack ``mcore_data``: recover what is provable, else fail clearly.

Checkpoints saved by megatron-core 0.8-0.14 on torch 2.9-2.11 without ``keep_mcore_data``
have no ``mcore_data`` in their ``.metadata``. megatron-core then fails a resume with
``AttributeError: 'Metadata' object has no attribute 'mcore_data'`` in
``get_reformulation_metadata``, and ``load_tensors_metadata`` describes N-D flattened
tensors with their stored, reformulated shape, silently.

What is read: whether the installed ``strategies.torch`` has ``get_reformulation_metadata``
reading ``Metadata.mcore_data`` (0.8-0.15), and the names it needs from that module.

What is rebound, in that module only:

* the ``get_reformulation_metadata`` global (looked up by ``TorchDistLoadShardedStrategy.load``
  at call time): megatron-core's own function runs first; only when it raises for the missing
  ``mcore_data`` are the shapes taken from what ``checkpoint_metadata`` can prove, and when
  one cannot be proved the load stops with a ``CheckpointingException`` naming the cause
  and the way out. Nothing is loaded with a guessed shape.
* ``TorchDistLoadShardedStrategy.load_tensors_metadata``: for such a checkpoint, megatron-core's
  own method runs on a copy of the Metadata given the ``mcore_data`` that can be proved, and
  raises instead of describing a tensor whose original shape cannot be.

Checkpoints that have ``mcore_data`` take megatron-core's path unchanged.
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

from mcore_autopatch.shared import versions
from mcore_autopatch.shared.values import Decision

# checkpoint_metadata is imported where a checkpoint without mcore_data is met, not at the
# watched import: most processes never load one.

MARK = "__mcore_autopatch__"
STRATEGY_CLASS = "TorchDistLoadShardedStrategy"
# What the recovery uses of megatron-core's strategies.torch module, all its own names.
NEEDED_NAMES = (
    "get_reformulation_metadata",
    "FileSystemReader",
    "nested_values",
    "is_nd_flattened_tensor",
    "nd_flattened_tensor_reformulated_global_shape",
    "TensorReformulationMetadata",
    "CheckpointingException",
)
HOW_TO_CONTINUE = (
    "resume with the tensor- and pipeline-parallel sizes the checkpoint was saved with (the "
    "data-parallel size may differ): the original shapes are then not needed; then save again with "
    "mcore-autopatch installed. `mcore-autopatch inspect %s` shows what the checkpoint holds"
)


def cause(folder: Any) -> str:
    return (
        "checkpoint %s has no mcore_data in its .metadata: megatron-core 0.8-0.14 keep there the original "
        "shape of each N-D flattened (distributed-optimizer) tensor, and torch 2.9-2.11 drop it when saving "
        "(FileSystemWriter.finish rebuilds the Metadata)" % folder
    )


class Evaluation:
    __slots__ = ("decision",)

    def __init__(
        self,
        decision: Decision,
    ) -> None:
        self.decision = decision


def reads_mcore_data(function: Any) -> bool:
    """Whether ``function``'s code (or code nested in it) reads an attribute ``mcore_data``."""
    code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        current = stack.pop()
        if "mcore_data" in current.co_names:
            return True
        stack.extend(c for c in current.co_consts if hasattr(c, "co_names"))
    return False


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    label = versions.megatron_core_label()
    function = vars(module).get("get_reformulation_metadata")
    if function is None or not reads_mcore_data(function):
        return Evaluation(Decision(False, "%s does not read mcore_data when loading" % label))
    missing = tuple(name for name in NEEDED_NAMES if name not in vars(module))
    strategy = vars(module).get(STRATEGY_CLASS)
    if missing or strategy is None or "load_tensors_metadata" not in vars(strategy):
        names = ", ".join(missing or (STRATEGY_CLASS + ".load_tensors_metadata",))
        return Evaluation(Decision(None, "%s reads mcore_data, but its loader lacks %s; not patching" % (label, names)))
    return Evaluation(
        Decision(
            True,
            "%s needs mcore_data to load N-D flattened tensors; checkpoints saved without it (torch 2.9-2.11) "
            "are loaded where their shapes can be proved, and refused with the cause otherwise" % label,
        )
    )


# --- the guards --------------------------------------------------------------------------


def recover_reformulation(module: ModuleType, sharded_state_dict: Any, metadata: Any, folder: Any) -> Dict[str, Any]:
    """``get_reformulation_metadata``'s answer for a checkpoint without ``mcore_data``, from
    what can be proved; raises megatron-core's ``CheckpointingException`` otherwise."""
    from mcore_autopatch.shared import checkpoint_metadata as cm

    entries = cm.tensor_entries(metadata)
    result: Dict[str, Any] = {}
    unprovable: List[str] = []
    for sh_ten in module.nested_values(sharded_state_dict):
        if not module.is_nd_flattened_tensor(sh_ten) or sh_ten.key not in entries:
            continue  # not flattened, or not in the checkpoint: megatron-core's own handling follows
        saved = tuple(int(s) for s in entries[sh_ten.key].size)
        if len(saved) != len(sh_ten.global_shape) + 1:
            continue  # stored unflattened (a legacy 1-D flattened tensor): megatron-core's own path
        wanted = tuple(module.nd_flattened_tensor_reformulated_global_shape(sh_ten))
        if wanted == saved:
            # Loaded as stored, without resharding: megatron-core compares the two
            # reformulated shapes and never uses the original one.
            shape: Optional[cm.Shape] = tuple(sh_ten.global_shape)
        else:
            proof = cm.shape_from_model_tensor(entries, sh_ten.key, saved)
            shape = proof[1] if proof else None
        if shape is None:
            unprovable.append(
                "%s (saved as %s, this job's layout needs %s)"
                % (sh_ten.key, cm.shape_text(saved), cm.shape_text(wanted))
            )
            continue
        result[sh_ten.key] = module.TensorReformulationMetadata(shape, saved)
    if unprovable:
        raise module.CheckpointingException(
            "%s. %d tensor(s) are loaded here with another layout than they were saved with, and their original "
            "shapes cannot be proved from the checkpoint: %s. To continue, %s"
            % (
                cause(folder),
                len(unprovable),
                "; ".join(unprovable[:5]) + ("; ..." if len(unprovable) > 5 else ""),
                HOW_TO_CONTINUE % folder,
            )
        )
    return result


def guard_get_reformulation_metadata(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    def get_reformulation_metadata(sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        try:
            return original(sharded_state_dict, checkpoint_dir)
        except AttributeError as exc:
            if "mcore_data" not in str(exc):
                raise
            metadata = module.FileSystemReader(checkpoint_dir).read_metadata()
            if isinstance(getattr(metadata, "mcore_data", None), dict):
                raise
            return recover_reformulation(module, sharded_state_dict, metadata, checkpoint_dir)

    _mark(get_reformulation_metadata, original)
    return get_reformulation_metadata


def guard_load_tensors_metadata(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    def load_tensors_metadata(self: Any, checkpoint_dir: Any, metadata: Any = None) -> Any:
        if metadata is None:
            metadata = module.FileSystemReader(checkpoint_dir).read_metadata()
        if isinstance(getattr(metadata, "mcore_data", None), dict):
            return original(self, checkpoint_dir, metadata)
        from mcore_autopatch.shared import checkpoint_metadata as cm

        tensors = cm.classify(metadata)
        unknown = [t.key for t in tensors if t.kind == "unknown"]
        if unknown:
            raise module.CheckpointingException(
                "%s, and the original shapes of %d tensor(s) stored as N-D flattened cannot be proved from it "
                "(%s), so their metadata cannot be described. %s"
                % (
                    cause(checkpoint_dir),
                    len(unknown),
                    ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else ""),
                    "`mcore-autopatch inspect %s` shows what the checkpoint holds" % checkpoint_dir,
                )
            )
        described = copy.copy(metadata)
        described.mcore_data = cm.recovered_mcore_data(tensors)  # a copy; the file is not touched
        return original(self, checkpoint_dir, described)

    _mark(load_tensors_metadata, original)
    return load_tensors_metadata


def _mark(function: Any, original: Any) -> None:
    function.__wrapped__ = original
    function.__doc__ = getattr(original, "__doc__", None)
    setattr(function, MARK, True)


def is_applied(module: ModuleType) -> bool:
    strategy = vars(module).get(STRATEGY_CLASS)
    return bool(
        getattr(vars(module).get("get_reformulation_metadata"), MARK, False)
        and getattr(vars(strategy).get("load_tensors_metadata") if strategy else None, MARK, False)
    )


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed:
        return ev.decision, is_applied(module)
    namespace = vars(module)
    strategy = namespace[STRATEGY_CLASS]
    function = namespace["get_reformulation_metadata"]
    if not getattr(function, MARK, False):
        namespace["get_reformulation_metadata"] = guard_get_reformulation_metadata(module, function)
    method = vars(strategy)["load_tensors_metadata"]
    if not getattr(method, MARK, False):
        strategy.load_tensors_metadata = guard_load_tensors_metadata(module, method)
    return ev.decision, True
