"""A full nvidia-resiliency-ext async checkpoint save and load, on a GPU (CUDA tensors).

    python nvrx_async_save.py CKPT_DIR

nvidia-resiliency-ext's async path stages CUDA tensors to the host and synchronizes CUDA, so
this runs only where ``torch.cuda.is_available()``; elsewhere it prints
``{"skipped": reason}``. One gloo rank (file store), a state dict of CUDA tensors, then what a
training loop does with nvidia-resiliency-ext's writer: ``save_state_dict_async_plan`` with
``FileSystemWriterAsync``, an ``AsyncRequest`` of the writer's save function with its
preload function, scheduled on an ``AsyncCallsQueue`` and finalized blocking (metadata
written by ``save_state_dict_async_finalize``), then ``torch.distributed.checkpoint.load``
into zeroed tensors. It never imports mcore_autopatch. Prints one JSON line.
"""

import json
import os
import sys
import tempfile
import traceback
from functools import partial

import torch


def main() -> int:
    folder = sys.argv[1]
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (torch %s)" % torch.__version__}))
        return 0
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    store = tempfile.mktemp(prefix="nvrx-store-")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    writer_module = sys.modules[FileSystemWriterAsync.__module__]
    result = {"torch": torch.__version__, "ok": False, "error": None}
    result["write_item_replaced"] = bool(getattr(vars(writer_module)["_write_item"], "__mcore_autopatch__", False))
    g = torch.Generator().manual_seed(11)
    expected = {"w": torch.randn(64, 64, generator=g), "b": torch.arange(32, dtype=torch.float32)}
    state = {k: v.cuda() for k, v in expected.items()}
    try:
        os.makedirs(folder, exist_ok=True)
        writer = FileSystemWriterAsync(folder, thread_count=2)
        # The first item is what finalize takes; what follows it differs between releases
        # (0.3.0 returns five items though its annotation says three).
        writer, metadata, dist_wrapper = save_state_dict_async_plan(state, writer)[0]
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        finalize = partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper)
        request = AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn)
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        queue.close()
        loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(loaded, checkpoint_id=folder)
        result["loaded_equal"] = all(torch.equal(loaded[k], v) for k, v in expected.items())
        result["ok"] = result["loaded_equal"]
    except Exception as exc:
        result["error"] = "%s: %s" % (type(exc).__name__, exc)
        result["traceback"] = traceback.format_exc()
    result["metadata_written"] = os.path.exists(os.path.join(folder, ".metadata"))
    dist.destroy_process_group()
    print(json.dumps(result, sort_keys=True))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
