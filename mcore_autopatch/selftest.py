"""``mcore-autopatch selftest``: a real, tiny megatron-core async checkpoint save and load.

One gloo rank with an in-memory store (no network, no GPU needed), a temporary folder,
``dist_checkpointing.save(..., async_sharded_save=True)`` then ``execute_sync()``, then
``dist_checkpointing.load`` and an exact comparison. With the fix switched off on an
affected stack it fails the way training jobs fail, and says so.
"""

import sys
import tempfile
import time
import warnings
from typing import Any, TextIO

PASSED, FAILED, CANNOT_RUN = 0, 1, 2
KEY = "mcore_autopatch.selftest.weight"


def run(out: TextIO = sys.stdout) -> int:
    started = time.perf_counter()
    try:
        import torch
        import torch.distributed as dist
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
    except Exception as exc:
        print("selftest cannot run: %s: %s" % (type(exc).__name__, exc), file=out)
        return CANNOT_RUN
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="mcore-autopatch-selftest-") as folder:
            warnings.simplefilter("ignore", FutureWarning)  # torch's ShardedTensor deprecation notice
            expected = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
            state: Any = {KEY: ShardedTensor.from_rank_offsets(KEY, expected.clone(), replica_id=0)}
            print("selftest: async save of one 64x64 float32 tensor to %s" % folder, file=out)
            try:
                request = dist_checkpointing.save(state, folder, async_sharded_save=True)
                request.execute_sync()
            except Exception as exc:
                print(
                    "selftest FAILED after %.2f s: the save raised %s: %s"
                    % (time.perf_counter() - started, type(exc).__name__, exc),
                    file=out,
                )
                return FAILED
            target: Any = {KEY: ShardedTensor.from_rank_offsets(KEY, torch.zeros_like(expected), replica_id=0)}
            loaded = dist_checkpointing.load(target, folder)
            if not torch.equal(loaded[KEY], expected):
                print("selftest FAILED: the loaded tensor differs from the saved one", file=out)
                return FAILED
    finally:
        if own_group:
            dist.destroy_process_group()
    print("selftest passed: saved and loaded back equal in %.2f s" % (time.perf_counter() - started), file=out)
    return PASSED
