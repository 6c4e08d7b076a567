"""FAKE megatron-core writer module, as an upstream rewrite might look (tests/fakes): not megatron-core's code.

It reaches torch's ``_write_item`` through the module object at call time, so it has no
``_write_item`` global for mcore-autopatch to rebind.
"""

try:
    from torch.distributed.checkpoint import filesystem as fake_torch_fs
except ImportError:
    fake_torch_fs = None


def fake_call_like_0_12(transforms, stream, data, write_item, storage_key):
    transform_list = [] if transforms is None else [transforms]
    return fake_torch_fs._write_item(*transform_list, stream, data, write_item, storage_key)
