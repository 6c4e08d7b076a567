"""What a checkpoint's ``.metadata`` says about megatron-core's N-D flattened tensors.

megatron-core 0.8+ saves a ``ShardedTensor`` with a ``flattened_range`` (the distributed
optimizer's ``optimizer.state.<state>.<param key>`` tensors) reformulated: a global shape
``[X, Y]`` with local chunks ``[x, y]`` is stored as ``[X // x, Y // y, x * y]`` with chunks
``[1, 1, n]``. The original ``[X, Y]`` is kept only in ``Metadata.mcore_data``. When that is
lost (torch 2.9-2.11, see ``fixes/keep_mcore_data.py``), the original shape can still be *proved* in
two ways, and this module never guesses beyond them:

* the tensor being loaded has the same reformulated shape as the saved one: megatron-core
  then loads it without resharding and never uses the original shape;
* the checkpoint holds the model tensor the optimizer state belongs to (``<param key>``, a
  suffix of the state's key) and the saved shape is exactly the reformulation of that
  tensor's global shape and chunks, as megatron-core builds the state from it.

Works on the unpickled objects by their attributes; imports neither torch nor megatron.
"""

import os
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

Shape = Tuple[int, ...]
ORIGINAL_SHAPE = "nd_reformulated_orig_global_shape"  # megatron-core's key inside mcore_data
OPTIMIZER_STATE = "optimizer.state."  # megatron-core flattens only optimizer state


class TensorInfo(NamedTuple):
    key: str
    saved_shape: Shape
    kind: str  # "regular", "flattened" or "unknown" (looks flattened; original shape not provable)
    shape: Optional[Shape]  # the original global shape of a flattened tensor, when known
    evidence: str


def tensor_entries(metadata: Any) -> Dict[str, Any]:
    """The tensor entries of ``metadata.state_dict_metadata`` (those with a size and chunks)."""
    entries = getattr(metadata, "state_dict_metadata", None) or {}
    return {key: e for key, e in entries.items() if hasattr(e, "size") and hasattr(e, "chunks")}


def has_mcore_data(metadata: Any) -> bool:
    return isinstance(getattr(metadata, "mcore_data", None), dict)


def reformulated(shape: Shape, chunk: Shape) -> Shape:
    """megatron-core's stored shape for a tensor of global ``shape`` saved in ``chunk`` pieces."""
    count = 1
    for size in chunk:
        count *= size
    return (*(g // c for g, c in zip(shape, chunk)), count)


def _chunk_shape(entry: Any) -> Optional[Shape]:
    """The one chunk shape of a regularly sharded tensor entry, else None."""
    shapes = {tuple(c.sizes) for c in entry.chunks}
    return shapes.pop() if len(shapes) == 1 else None


def looks_reformulated(entry: Any) -> bool:
    """Stored as megatron-core stores N-D flattened tensors: 2+ axes, chunks ``1 x ... x 1 x n``."""
    size = tuple(entry.size)
    return len(size) >= 2 and all(all(s == 1 for s in tuple(c.sizes)[:-1]) for c in entry.chunks)


def shape_from_model_tensor(entries: Dict[str, Any], key: str, saved_shape: Shape) -> Optional[Tuple[str, Shape]]:
    """(model key, its global shape) when the checkpoint proves ``key``'s original shape."""
    best: Optional[Tuple[str, Shape]] = None
    for other, entry in entries.items():
        if other == key or not key.endswith("." + other):
            continue
        size = tuple(entry.size)
        chunk = _chunk_shape(entry)
        if chunk is None or len(size) + 1 != len(saved_shape) or any(c <= 0 or g % c for g, c in zip(size, chunk)):
            continue
        if reformulated(size, chunk) == saved_shape and (best is None or len(other) > len(best[0])):
            best = (other, size)
    return best


def classify(metadata: Any) -> List[TensorInfo]:
    """Every tensor of the checkpoint, with whether it is N-D flattened and its original shape."""
    entries = tensor_entries(metadata)
    mcore_data = getattr(metadata, "mcore_data", None)
    out: List[TensorInfo] = []
    for key in sorted(entries):
        entry = entries[key]
        saved = tuple(int(s) for s in entry.size)
        if isinstance(mcore_data, dict):
            original = (mcore_data.get(key) or {}).get(ORIGINAL_SHAPE)
            if original is not None:
                out.append(TensorInfo(key, saved, "flattened", tuple(original), "mcore_data"))
            else:
                out.append(TensorInfo(key, saved, "regular", None, "mcore_data"))
            continue
        if not looks_reformulated(entry):
            out.append(TensorInfo(key, saved, "regular", None, "its chunks are not 1 x ... x 1 x n"))
            continue
        proof = shape_from_model_tensor(entries, key, saved)
        if proof is not None:
            evidence = "the reformulation of %s %s, saved beside it" % (proof[0], shape_text(proof[1]))
            out.append(TensorInfo(key, saved, "flattened", proof[1], evidence))
        elif OPTIMIZER_STATE in key:
            evidence = "optimizer state stored like an N-D flattened tensor, without its model tensor"
            out.append(TensorInfo(key, saved, "unknown", None, evidence))
        else:
            out.append(TensorInfo(key, saved, "regular", None, "megatron-core flattens only optimizer state"))
    return out


def recovered_mcore_data(tensors: Iterable[TensorInfo]) -> Optional[Dict[str, Dict[str, Shape]]]:
    """``mcore_data`` as megatron-core writes it (an entry per tensor; the original shape for
    flattened ones), or None when some tensor's shape is not provable."""
    out: Dict[str, Dict[str, Shape]] = {}
    for info in tensors:
        if info.kind == "unknown":
            return None
        out[info.key] = {ORIGINAL_SHAPE: info.shape} if info.kind == "flattened" and info.shape else {}
    return out


def shape_text(shape: Iterable[int]) -> str:
    return "(%s)" % ", ".join(str(s) for s in shape)


# --- reading a checkpoint folder ----------------------------------------------------------

METADATA_FILE = ".metadata"


class CheckpointProblem(Exception):
    """A folder that is not a readable torch_dist checkpoint; the message says why."""


def read_metadata(folder: str) -> Any:
    """Unpickle ``folder/.metadata`` (torch must be importable; megatron-core too when the
    checkpoint holds its save plans)."""
    import pickle

    path = os.path.join(folder, METADATA_FILE)
    if not os.path.isdir(folder):
        raise CheckpointProblem("%s is not a folder" % folder)
    if not os.path.isfile(path):
        raise CheckpointProblem(
            "%s has no %s file: not a torch_dist checkpoint (or not a finished one)" % (folder, METADATA_FILE)
        )
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except ModuleNotFoundError as exc:
        raise CheckpointProblem(
            "cannot read %s: it needs the module %s, not importable here" % (path, exc.name)
        ) from exc
    except ValueError as exc:
        if "too many values to unpack (expected 5)" not in str(exc):
            raise CheckpointProblem("cannot read %s: %s: %s" % (path, type(exc).__name__, exc)) from exc
        import sys

        torch = getattr(sys.modules.get("torch"), "__version__", "here")
        raise CheckpointProblem(
            "cannot read %s with torch %s: it was written by torch 2.15 or later, whose TensorProperties carry a "
            "sixth field (strides) that torch 2.14 and earlier cannot unpickle; read or resume it with torch 2.15 "
            "or later (docs/troubleshooting.md)" % (path, torch)
        ) from exc
    except Exception as exc:
        raise CheckpointProblem("cannot read %s: %s: %s" % (path, type(exc).__name__, exc)) from exc
