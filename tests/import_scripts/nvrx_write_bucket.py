"""nvidia-resiliency-ext's write worker, driven for real on the CPU.

    python nvrx_write_bucket.py OUT_DIR

nvidia-resiliency-ext's async save path asks for CUDA, but the function its forked write
workers run, ``FileSystemWriterAsync.write_preloaded_data(transform_list, local_proc_idx,
write_bucket, results_queue, count_queue, use_fsync)``, takes buckets of CPU data. This
script imports the writer module (whichever nvidia-resiliency-ext is on PYTHONPATH), builds
one bucket (a BYTE_IO item and three tensors), passes the writer's own transforms as its
``get_save_function_and_args`` would, and calls the worker function in this process. It
never imports mcore_autopatch. Prints one JSON line: the result or the worker's error, the
sha256 of the file written, and what the WriteResults say.
"""

import hashlib
import io
import json
import os
import queue
import sys

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

WRITER = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"


def tensor_item(name: str, tensor: torch.Tensor) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(name, offset=torch.Size([0] * tensor.dim())),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.size()),
            properties=TensorProperties.create_from_tensor(tensor),
            size=tensor.size(),
        ),
    )


def main() -> int:
    out_dir = sys.argv[1]
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

    writer_module = sys.modules[WRITER]
    storage_writer = FileSystemWriterAsync(out_dir)
    transform_list = [storage_writer.transforms] if hasattr(storage_writer, "transforms") else []
    g = torch.Generator().manual_seed(7)
    tensors = {
        "model.weight": torch.randn(16, 32, generator=g),
        "model.bf16": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.int64": torch.arange(40, dtype=torch.int64).reshape(5, 8),
    }
    bytes_data = [(WriteItem(index=MetadataIndex("extra"), type=WriteItemType.BYTE_IO), io.BytesIO(b"nvrx" * 64))]
    tensor_data = [(tensor_item(name, t), t) for name, t in tensors.items()]
    file_name = os.path.join(out_dir, "__0_0.distcp")
    bucket = (file_name, "__0_0.distcp", (bytes_data, tensor_data))
    results: "queue.Queue[object]" = queue.Queue()
    count: "queue.Queue[object]" = queue.Queue()
    count.put(0)  # what write_preloaded_data_multiproc puts in for each worker
    FileSystemWriterAsync.write_preloaded_data(transform_list, 0, bucket, results, count, True)
    _, output = results.get_nowait()
    report = {
        "torch": torch.__version__,
        "write_item_replaced": bool(getattr(vars(writer_module)["_write_item"], "__mcore_autopatch__", False)),
        "ok": not isinstance(output, BaseException),
        "error": "%s: %s" % (type(output).__name__, output) if isinstance(output, BaseException) else None,
    }
    if report["ok"]:
        with open(file_name, "rb") as f:
            report["sha256"] = hashlib.sha256(f.read()).hexdigest()
        report["results"] = [
            [r.index.fqn, r.size_in_bytes, r.storage_data.offset, r.storage_data.length] for r in output
        ]
    print(json.dumps(report, sort_keys=True))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
