"""FAKE megatron-core writer module (tests/fakes/fake_megatron_0_12_1): not megatron-core's code.

It has what mcore-autopatch works on: a module-level ``_write_item`` global imported from
torch's filesystem module, looked up at call time by callers shaped like the releases'
``write_preloaded_data``. Unlike megatron-core it still imports when torch is missing or
lacks ``_write_item`` (the global is then ``None``), so tests can see what mcore-autopatch
does in those environments.
"""

try:
    from torch.distributed.checkpoint.filesystem import _write_item
except ImportError:  # no torch, or a torch without _write_item
    _write_item = None


def fake_call_like_0_9(stream, data, write_item, storage_key):
    """megatron-core 0.9-0.11: the four legacy arguments."""
    return _write_item(stream, data, write_item, storage_key)


def fake_call_like_0_12(transforms, stream, data, write_item, storage_key):
    """megatron-core 0.12.x: the writer's transforms in front, when it has them."""
    transform_list = [] if transforms is None else [transforms]
    return _write_item(*transform_list, stream, data, write_item, storage_key)


def fake_call_like_0_13(transforms, stream, data, write_item, storage_key, serialization_format):
    """megatron-core 0.13+ on torch 2.8+: serialization_format by keyword."""
    return _write_item(transforms, stream, data, write_item, storage_key, serialization_format=serialization_format)
