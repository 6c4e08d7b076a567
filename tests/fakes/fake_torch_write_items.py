"""FAKE torch ``_write_item`` functions, one per signature generation (not torch's code).

Real torch 2.6.0, 2.7.1, 2.8.0, 2.9.0, 2.13.0 and 2.14.1 are tested end to end
(tests/test_e2e_save.py); these fakes serve the fast unit tests of the policy and the safe
caller, and the interpreters without torch (other CPythons). Each released generation's
fake is checked against the real release's signature by
``test_fake_signatures_are_the_real_releases``; the ``future`` ones are signatures no
release has. They reproduce what the fix depends on: each generation's exact parameter
list (names, kinds, defaults), the failures a wrong call gets (``TypeError`` for a missing
argument, ``AttributeError`` when something that is not a transforms object sits in the
transforms place), and the data-loss traps (torch 2.7 with a truthy ``safe_tensors``, and
``SAFETENSORS`` mode, write no tensor bytes). Every call is recorded exactly as received,
positional and keyword arguments apart, in ``FAKE_CALLS``; the record is made before the
call is bound, so a call that fails is recorded too.

Standard library only, Python 3.8+: the fake ``torch`` package in ``fake_torch/`` loads this
file in interpreters without torch.
"""

import enum
import inspect
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

FAKE_TENSOR_BYTES = b"FAKE-TORCH-SAVE:"


class FakeSerializationFormat(enum.Enum):
    """FAKE of torch 2.8's ``SerializationFormat``."""

    TORCH_SAVE = "torch_save"
    SAFETENSORS = "safetensors"


class FakeStorageWriterTransforms:
    """FAKE of torch 2.7's ``_StorageWriterTransforms``: no extensions, stream unchanged."""

    def __init__(self, extensions: Any = None) -> None:
        self.extensions = list(extensions or ())

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> Tuple[Any, List[Any]]:
        return raw_stream, []


class FakeWriteResult(NamedTuple):
    """What a fake ``_write_item`` returns: which fake ran, and whether tensor bytes were written."""

    fake: str
    storage_key: Any
    tensor_bytes_written: bool


class FakeCall(NamedTuple):
    """One call of a fake ``_write_item``, exactly as it was made."""

    fake: str
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


FAKE_CALLS: List[FakeCall] = []


def _fake_save(
    name: str, transforms: Any, stream: Any, data: Any, write_item: Any, storage_key: Any, save: bool
) -> Any:
    if transforms is not None:
        # torch >= 2.7 wraps the stream through the transforms object first.
        stream, _ = transforms.transform_save_stream(write_item, stream)
    if save:
        stream.write(FAKE_TENSOR_BYTES + repr(data).encode())
    return FakeWriteResult(name, storage_key, save)


def _recording(body: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``body`` as a recorded fake that reports ``body``'s exact signature to ``inspect``."""

    def fake(*args: Any, **kwargs: Any) -> Any:
        FAKE_CALLS.append(FakeCall(name, args, dict(kwargs)))
        return body(*args, **kwargs)

    fake.__name__ = fake.__qualname__ = name
    fake.__doc__ = body.__doc__
    fake.__signature__ = inspect.signature(body)  # type: ignore[attr-defined]
    return fake


def _torch_2_6(stream, data, write_item, storage_key):  # type: ignore[no-untyped-def]
    """FAKE torch 2.3-2.6 ``_write_item(stream, data, write_item, storage_key)``."""
    return _fake_save("fake_torch_2_6_write_item", None, stream, data, write_item, storage_key, True)


def _torch_2_7(transforms, stream, data, write_item, storage_key, safe_tensors=False):  # type: ignore[no-untyped-def]
    """FAKE torch 2.7 ``_write_item``: a truthy ``safe_tensors`` skips the tensor bytes."""
    return _fake_save("fake_torch_2_7_write_item", transforms, stream, data, write_item, storage_key, not safe_tensors)


def _torch_2_8(transforms, stream, data, write_item, storage_key, serialization_format):  # type: ignore[no-untyped-def]
    """FAKE torch 2.8+ ``_write_item``: ``serialization_format`` required; SAFETENSORS writes no tensor bytes."""
    save = serialization_format == FakeSerializationFormat.TORCH_SAVE
    return _fake_save("fake_torch_2_8_write_item", transforms, stream, data, write_item, storage_key, save)


def _future_default_torch_save(  # type: ignore[no-untyped-def]
    transforms, stream, data, write_item, storage_key, serialization_format=FakeSerializationFormat.TORCH_SAVE
):
    """FAKE future torch: ``serialization_format`` defaults to TORCH_SAVE."""
    save = serialization_format == FakeSerializationFormat.TORCH_SAVE
    return _fake_save("fake_torch_future_default_torch_save", transforms, stream, data, write_item, storage_key, save)


def _future_default_safetensors(  # type: ignore[no-untyped-def]
    transforms, stream, data, write_item, storage_key, serialization_format=FakeSerializationFormat.SAFETENSORS
):
    """FAKE future torch: ``serialization_format`` defaults to SAFETENSORS (no tensor bytes here)."""
    save = serialization_format == FakeSerializationFormat.TORCH_SAVE
    return _fake_save("fake_torch_future_default_safetensors", transforms, stream, data, write_item, storage_key, save)


def _future_keyword_only(transforms, stream, data, write_item, storage_key, *, serialization_format):  # type: ignore[no-untyped-def]
    """FAKE future torch: ``serialization_format`` is keyword-only and required."""
    save = serialization_format == FakeSerializationFormat.TORCH_SAVE
    return _fake_save("fake_torch_future_keyword_only", transforms, stream, data, write_item, storage_key, save)


def _future_renamed(transforms, stream, data, write_item, storage_key, save_format):  # type: ignore[no-untyped-def]
    """FAKE future torch: the required 6th parameter has a name mcore-autopatch does not know."""
    save = save_format == FakeSerializationFormat.TORCH_SAVE
    return _fake_save("fake_torch_future_renamed", transforms, stream, data, write_item, storage_key, save)


def _future_varargs(*args, **kwargs):  # type: ignore[no-untyped-def]
    """FAKE future torch: ``_write_item(*args, **kwargs)``, whose needs cannot be read."""
    return FakeWriteResult("fake_torch_future_varargs", None, False)


fake_torch_2_6_write_item = _recording(_torch_2_6, "fake_torch_2_6_write_item")
fake_torch_2_7_write_item = _recording(_torch_2_7, "fake_torch_2_7_write_item")
fake_torch_2_8_write_item = _recording(_torch_2_8, "fake_torch_2_8_write_item")
fake_torch_future_default_torch_save = _recording(_future_default_torch_save, "fake_torch_future_default_torch_save")
fake_torch_future_default_safetensors = _recording(_future_default_safetensors, "fake_torch_future_default_safetensors")
fake_torch_future_keyword_only = _recording(_future_keyword_only, "fake_torch_future_keyword_only")
fake_torch_future_renamed = _recording(_future_renamed, "fake_torch_future_renamed")
fake_torch_future_varargs = _recording(_future_varargs, "fake_torch_future_varargs")

# The three released generations, by the torch minor that introduced each signature.
FAKE_GENERATIONS: Dict[str, Callable[..., Any]] = {
    "2.6": fake_torch_2_6_write_item,
    "2.7": fake_torch_2_7_write_item,
    "2.8": fake_torch_2_8_write_item,
}
# What each generation's module has beside _write_item.
FAKE_GENERATION_EXTRAS: Dict[str, Tuple[str, ...]] = {
    "2.6": (),
    "2.7": ("_StorageWriterTransforms",),
    "2.8": ("_StorageWriterTransforms", "SerializationFormat"),
}
FAKE_EXTRA_OBJECTS: Dict[str, Any] = {
    "_StorageWriterTransforms": FakeStorageWriterTransforms,
    "SerializationFormat": FakeSerializationFormat,
}
