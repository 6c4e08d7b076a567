"""``mcore-autopatch selftest``: a real, tiny megatron-core async checkpoint save and load.

One gloo rank with an in-memory store (no network, no GPU needed), a temporary folder,
``dist_checkpointing.save(..., async_sharded_save=True)`` then ``execute_sync()`` (the
write a training job's async worker does), then ``dist_checkpointing.load`` and an exact
comparison. It runs megatron-core's own writer through the normal import system, so the
fix is in play exactly when it would be in a job started the same way. With the fix
switched off on an affected stack it fails the way training jobs fail, and says so.

Exit codes: 0 the round trip is equal, 1 it failed, 2 it cannot run here (torch or
megatron-core missing, or a megatron-core whose save path needs CUDA on a CPU machine).
"""

import importlib
import sys
import tempfile
import time
from typing import Any, Optional, TextIO

from mcore_autopatch import WRITER_MODULE

PASSED, FAILED, CANNOT_RUN = 0, 1, 2
KEY = "mcore_autopatch.selftest.weight"

_YES_NO = {True: "yes", False: "no", None: "cannot tell"}


def _say(out: TextIO, message: str) -> None:
    print("selftest: %s" % message, file=out, flush=True)


def _needs_cuda(exc: BaseException, torch: Any) -> bool:
    """A save path that asks for CUDA (megatron-core 0.16+) on a machine without it."""
    return "CUDA" in str(exc) and not torch.cuda.is_available()


def run(out: TextIO = sys.stdout, folder: Optional[str] = None) -> int:
    started = time.perf_counter()
    try:
        from mcore_autopatch.report import quiet_imports

        with quiet_imports():
            import torch
            import torch.distributed as dist
            from megatron.core import dist_checkpointing
            from megatron.core.dist_checkpointing import ShardedTensor

            # The save would import the writer later; importing it now, the same way, lets
            # the report below say what the save is about to run.
            importlib.import_module(WRITER_MODULE)
    except Exception as exc:
        _say(out, "cannot run: %s: %s" % (type(exc).__name__, exc))
        return CANNOT_RUN

    from mcore_autopatch import report

    info = report.status()  # the writer module is imported now: this is the fix's state for the save
    _say(
        out,
        "torch %s, megatron-core %s; fix needed: %s, applied: %s (%s)"
        % (info["torch"], info["megatron_core"], _YES_NO[info["needed"]], _YES_NO[info["applied"]], info["reason"]),
    )
    own_group = not dist.is_initialized()
    if own_group:
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        except Exception as exc:  # e.g. a hostname gloo cannot resolve inside a build sandbox
            _say(out, "cannot run: gloo did not start (%s: %s); try GLOO_SOCKET_IFNAME=lo" % (type(exc).__name__, exc))
            return CANNOT_RUN
    try:
        with quiet_imports(), tempfile.TemporaryDirectory(prefix="mcore-autopatch-selftest-", dir=folder) as ckpt:
            expected = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
            state: Any = {KEY: ShardedTensor.from_rank_offsets(KEY, expected.clone(), replica_id=0)}
            _say(out, "async save of one 64x64 float32 tensor (gloo, 1 rank) to %s" % ckpt)
            save_started = time.perf_counter()
            try:
                request = dist_checkpointing.save(state, ckpt, async_sharded_save=True)
                request.execute_sync()
            except Exception as exc:
                error = "%s: %s" % (type(exc).__name__, exc)
                if _needs_cuda(exc, torch):
                    _say(out, "cannot run: this megatron-core's save path needs CUDA (%s)" % error)
                    return CANNOT_RUN
                _say(out, "FAILED after %.2f s: the save raised %s" % (time.perf_counter() - started, error))
                if "_write_item()" in str(exc):
                    _say(out, "this is the failure mcore-autopatch fixes; %s" % (info["advice"] or info["reason"]))
                return FAILED
            saved = time.perf_counter() - save_started
            _say(out, "saved in %.2f s; loading it back into a zeroed tensor" % saved)
            load_started = time.perf_counter()
            target: Any = {KEY: ShardedTensor.from_rank_offsets(KEY, torch.zeros_like(expected), replica_id=0)}
            try:
                loaded = dist_checkpointing.load(target, ckpt)
            except Exception as exc:
                _say(out, "FAILED: the load raised %s: %s" % (type(exc).__name__, exc))
                return FAILED
            if not torch.equal(loaded[KEY], expected):
                _say(out, "FAILED: the loaded tensor differs from the saved one")
                return FAILED
            loaded_in = time.perf_counter() - load_started
    finally:
        if own_group:
            dist.destroy_process_group()
    _say(
        out,
        "passed: saved and loaded back equal in %.2f s (save %.2f s, load %.2f s)"
        % (time.perf_counter() - started, saved, loaded_in),
    )
    return PASSED
