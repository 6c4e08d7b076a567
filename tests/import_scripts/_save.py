"""A real async megatron-core save and load, and what the writer module looks like.

Shared by the import-situation scripts beside it. It never imports mcore_autopatch: what
it observes is only what the installed wheel did (or did not do) to the process. Every
script prints one JSON line (``emit``) that tests/test_e2e_imports.py reads.
"""

import inspect
import json
import os
import sys
import tempfile
import traceback
import warnings
from typing import Any, Dict, List, Optional

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
STRATEGIES_TORCH = "megatron.core.dist_checkpointing.strategies.torch"
TORCH_FS = "torch.distributed.checkpoint.filesystem"
MARK = "__mcore_autopatch__"


def add_paths(argv: List[str]) -> List[str]:
    """Append every ``--path P`` of ``argv`` to ``sys.path``; return the other arguments.

    For ``-S``/``-I``/``-E`` runs, where ``PYTHONPATH`` or site-packages are not used.
    """
    rest: List[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--path":
            sys.path.append(next(args))
        else:
            rest.append(arg)
    return rest


def init_distributed() -> None:
    """One gloo rank, with a file store outside any checkpoint folder."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="import-scripts-store-")
        dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)


def save_and_load(folder: str, strategies_torch: Any = None) -> Dict[str, Any]:
    """``dist_checkpointing.save(..., async_sharded_save=True)``, ``execute_sync()``, load.

    With ``strategies_torch`` (a ``...strategies.torch`` module object) the save strategy is
    built from that module, so a reloaded or re-imported module is the one that writes.
    """
    warnings.simplefilter("ignore", FutureWarning)  # torch's ShardedTensor deprecation notice
    result: Dict[str, Any] = {"ok": False, "error": None}
    try:
        import torch
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        init_distributed()
        os.makedirs(folder, exist_ok=True)
        tensor = torch.arange(64, dtype=torch.float32).reshape(4, 16) / 7
        sharded = {"w": ShardedTensor.from_rank_offsets("w", tensor.clone(), replica_id=0)}
        template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(tensor), replica_id=0)}
        strategy = None
        if strategies_torch is not None:
            strategy = strategies_torch.TorchDistSaveShardedStrategy("torch_dist", 1)
        request = dist_checkpointing.save(sharded, folder, sharded_strategy=strategy, async_sharded_save=True)
        request.execute_sync()  # the writer, the barrier and the finalize functions, here
        loaded = dist_checkpointing.load(template, folder)
        result["loaded_equal"] = bool(torch.equal(loaded["w"], tensor))
        result["ok"] = result["loaded_equal"]
    except Exception as exc:
        result["error"] = "%s: %s" % (type(exc).__name__, exc)
        result["traceback"] = traceback.format_exc()
    return result


def is_ours(obj: object) -> bool:
    return bool(getattr(obj, MARK, False))


def write_item_report(module: Optional[Any] = None) -> Dict[str, Any]:
    """Whether the writer's ``_write_item`` is mcore-autopatch's, wrapping torch's exactly once."""
    writer = module if module is not None else sys.modules.get(WRITER)
    fs = sys.modules.get(TORCH_FS)
    current = vars(writer).get("_write_item") if writer is not None else None
    wrapped = getattr(current, "__wrapped__", None)
    levels = 0
    obj = current
    while is_ours(obj):
        levels += 1
        obj = getattr(obj, "__wrapped__", None)
    return {
        "marked": is_ours(current),
        "wraps_torch_once": bool(
            fs is not None and wrapped is getattr(fs, "_write_item", object()) and not is_ours(wrapped)
        ),
        "levels": levels,
        "is_torch_original": bool(fs is not None and current is getattr(fs, "_write_item", None)),
        "name": "%s.%s" % (getattr(current, "__module__", "?"), getattr(current, "__qualname__", current)),
    }


def used_by_class(writer_class: Any) -> Dict[str, Any]:
    """The ``_write_item`` that ``writer_class.write_preloaded_data`` really resolves when it runs."""
    function = writer_class.__dict__["write_preloaded_data"]
    function = inspect.unwrap(getattr(function, "__func__", function))  # a staticmethod over @_disable_gc()
    return {"marked": is_ours(function.__globals__.get("_write_item"))}


def our_finders() -> List[str]:
    """mcore-autopatch finders on ``sys.meta_path``, found without importing mcore_autopatch."""
    return [
        repr(entry)
        for entry in sys.meta_path
        if type(entry).__module__ == "mcore_autopatch" or getattr(type(entry), "_mcore_autopatch_finder", False)
    ]


def emit(result: Dict[str, Any]) -> None:
    print(json.dumps(result, sort_keys=True, default=repr))
    sys.stdout.flush()
