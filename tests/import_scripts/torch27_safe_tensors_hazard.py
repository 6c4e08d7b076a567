"""torch 2.7's ``_write_item`` with and without a 6th positional argument, for real.

Calls torch's own ``torch.distributed.checkpoint.filesystem._write_item`` (no megatron-core,
no mcore_autopatch) for one tensor write item, three ways: the five arguments torch 2.7
expects; the same plus a truthy 6th positional (what a fix that appended
``SerializationFormat.TORCH_SAVE`` positionally would pass: it lands in ``safe_tensors``);
and ``serialization_format=`` by keyword. Prints one JSON line: for each call, how many
bytes reached the stream, what the WriteResult claims, and whether torch.load reads the
tensor back from those bytes.
"""

import inspect
import io
import json

import torch
import torch.distributed.checkpoint.filesystem as fs
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

tensor = torch.arange(1024, dtype=torch.float32).reshape(32, 32) / 3
item = WriteItem(
    index=MetadataIndex("w"),
    type=WriteItemType.TENSOR,
    tensor_data=TensorWriteData(
        chunk=ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=tensor.size()),
        properties=TensorProperties.create_from_tensor(tensor),
        size=tensor.size(),
    ),
)


def call(*extra_args, **extra_kwargs):
    stream = io.BytesIO()
    try:
        result = fs._write_item(fs._StorageWriterTransforms(), stream, tensor, item, "key", *extra_args, **extra_kwargs)
    except TypeError as exc:
        return {"error": "TypeError: %s" % exc}
    written = stream.getvalue()
    try:
        loaded_equal = bool(torch.equal(torch.load(io.BytesIO(written), weights_only=True), tensor))
    except Exception as exc:
        loaded_equal = "%s: %s" % (type(exc).__name__, str(exc)[:120])
    return {"bytes_written": len(written), "claimed_length": result.storage_data.length, "loaded_equal": loaded_equal}


print(
    json.dumps(
        {
            "torch": torch.__version__,
            "parameters": list(inspect.signature(fs._write_item).parameters),
            "tensor_bytes": tensor.numel() * tensor.element_size(),
            "five_arguments": call(),
            "truthy_sixth_positional": call("torch_save"),
            "serialization_format_keyword": call(serialization_format="torch_save"),
        }
    )
)
