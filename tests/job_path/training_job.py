"""A training job's checkpoint path, as Megatron-LM's megatron/training/checkpointing.py
(core_r0.12.1) runs it, with real megatron-core APIs and a model-free state.

It never imports mcore_autopatch: whether it works depends only on what is installed.

    training_job.py --launch 2 save   --root DIR [--iterations 3] [--persistent]
    training_job.py --launch 2 resume --root DIR [--split shifted] [--then-save]
    training_job.py --launch 1 resume --root DIR        # another data-parallel split

save: each rank builds a model-style state (a tensor sharded across the ranks like a
tensor-parallel weight, layer-stacked and 1-D weights replicated across data-parallel ranks,
the ``rng_state`` ShardedObject with Python's, numpy's and torch's generator states, common
state with ``args`` as the ``argparse.Namespace`` Megatron-LM keeps there) and a
distributed-optimizer-style state (the
``fully_sharded_model_space`` layout: ``optimizer.state.<state>.<param key>`` tensors made
from each model ShardedTensor with ``dataclasses.replace`` and a ``flattened_range``, the
data-parallel ranks holding uneven pieces). Then, as the training loop does: the default
torch_dist save strategy with the cached checkpoint structure
(``--ckpt-assume-constant-structure``) inside ``FullyParallelSaveStrategyWrapper``, kept for
later saves; ``dist_checkpointing.save(..., async_sharded_save=True)`` with a finalize function
that writes the tracker file; ``AsyncCallsQueue.schedule_async_request``; training steps
that call ``maybe_finalize_async_calls(blocking=False)``; finalized before the next save.

resume: a fresh job reads the tracker file and the common state, loads the last checkpoint
through ``FullyParallelLoadStrategyWrapper`` (strict: assume_ok_unexpected, Megatron-LM's
default) and compares every value with what the save held. ``--then-save`` saves once more,
plugging the load strategy's metadata into the save strategy as checkpointing.py does, and
reports whether megatron-core reused it.

Values depend on the iteration, never on the layout, so a job with any data-parallel split
can check what it loaded. One JSON line per job (``--json``).

Each release runs the path its own Megatron-LM ran: 0.6 saves synchronously with the default
strategy and loads plainly (no async saves, no fully parallel wrappers); 0.7 adds the fully
parallel wrappers and async saves; 0.8 the cached structure; 0.9 strict load handling.
``--pg-timeout`` bounds how long ranks wait for a rank that failed (gloo's default is 30 min).
"""

import argparse
import dataclasses
import datetime
import hashlib
import inspect
import io
import json
import os
import pickle
import platform
import random
import sys
import time
import traceback
import warnings
import zlib

# Megatron-LM runs this path on GPUs. On a CPU-only machine the few CUDA calls megatron-core
# makes on it are redirected (see cpu_stand_in_for_cuda.py) in every rank and in the
# processes ranks fork or spawn (they inherit RANK); never in the launcher.
if os.environ.get("CPU_STAND_IN_FOR_CUDA") == "1" and "RANK" in os.environ:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_stand_in_for_cuda

    cpu_stand_in_for_cuda.install()

# A slow file system for some iterations' writes (``--slow-write``): the write processes
# megatron-core forks inherit it; a spawned persistent worker re-imports this file.
if os.environ.get("JOB_SLOW_WRITES"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import slow_file_system

    slow_file_system.install(os.environ["JOB_SLOW_WRITES"])
# A failing write (``--fault``), likewise in the faulty rank's spawned worker.
if os.environ.get("JOB_FAULTY_WRITES"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import faulty_writes

    faulty_writes.install(os.environ["JOB_FAULTY_WRITES"])

TRACKER = "latest_checkpointed_iteration.txt"
HIDDEN, VOCAB, LAYERS = 6, 8, 2
STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=["save", "resume"])
    p.add_argument("--root", required=True, help="the job's checkpoint folder (iter_XXXXXXX below it)")
    p.add_argument("--iterations", type=int, default=3, help="save: how many checkpoints")
    p.add_argument("--persistent", action="store_true", help="megatron's persistent (spawned) checkpoint worker")
    p.add_argument("--split", choices=["even", "shifted"], default="even", help="data-parallel split of the optimizer")
    p.add_argument(
        "--state",
        choices=["full", "optimizer-only", "model"],
        default="full",
        help="model: the model state and the rng state only (no distributed-optimizer state)",
    )
    p.add_argument(
        "--padded-vocab",
        type=int,
        help="the word embeddings and an output layer have this many rows (a vocabulary padded to a multiple "
        "of make_vocab_size_divisible_by x TP), saved with allow_shape_mismatch as megatron-core saves them",
    )
    p.add_argument(
        "--saved-vocab",
        type=int,
        help="resume: the padded vocabulary the checkpoint was saved with (the overlap is expected, zeros elsewhere)",
    )
    p.add_argument(
        "--rigid-vocab",
        action="store_true",
        help="the vocabulary tensors are saved without allow_shape_mismatch (another shape must then fail)",
    )
    p.add_argument(
        "--optimizer-layout",
        choices=["model", "bucket"],
        default="model",
        help="the distributed optimizer's sharding_type: fully_sharded_model_space (N-D flattened, 0.8+) or "
        "fully_sharded_bucket_space (1-D flattened buckets: what Megatron-LM saved with torch_dist on 0.6/0.7)",
    )
    p.add_argument(
        "--whole-1d",
        action="store_true",
        help="a 1-D weight's optimizer state lies wholly in rank 0's piece (megatron-core 0.8 cannot save "
        "a 1-D flattened tensor split among ranks: torch rejects the shard volume)",
    )
    p.add_argument(
        "--plain-load",
        action="store_true",
        help="resume without FullyParallelLoadStrategyWrapper (Megatron-LM's default before --ckpt-fully-parallel-load;"
        " 0.7/0.8's exchange all-gathers uneven pieces, which gloo refuses and NCCL serves)",
    )
    p.add_argument("--then-save", action="store_true", help="resume: save once more, reusing the loaded metadata")
    p.add_argument(
        "--strict",
        default="assume_ok_unexpected",
        help="resume: the load's StrictHandling (Megatron-LM's --dist-ckpt-strictness; raise_all, log_all, ... "
        "compare the checkpoint's keys with the request's, reading its tensors' metadata)",
    )
    p.add_argument(
        "--read-metadata",
        action="store_true",
        help="resume: also describe the checkpoint without loading it, as tools and strict loads do "
        "(dist_checkpointing.load_tensors_metadata and load_sharded_metadata)",
    )
    p.add_argument(
        "--scenario",
        choices=["sequential", "async-results", "faults"],
        default="sequential",
        help="save: one save after the other (each finalized before the next), or async-results: "
        "saves that overlap, a synchronous save while an async one is in flight, an abandoned save "
        "(tests/test_e2e_async_results.py); faults: save 1, save 2 failing on one rank (--fault), training "
        "steps until every rank raises, then save 3 and a load of it (tests/test_e2e_async_faults.py)",
    )
    p.add_argument(
        "--fault",
        choices=[
            "writer-sigkill",
            "writer-segfault",
            "enospc",
            "async-process-kill",
            "worker-kill",
            "preload-raises",
        ],
        help="faults: what goes wrong on --fault-rank during save 2 (a writer process killed or segfaulting, a full "
        "disk, the temporal/distributed async process or the persistent worker killed, preload_fn raising)",
    )
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument(
        "--async-strategy",
        choices=["nvrx", "mcore"],
        default="nvrx",
        help="megatron-core 0.17+: whose async save path (Megatron-LM's default: nvidia-resiliency-ext's); its "
        "AsyncCallsQueue comes with it",
    )
    p.add_argument(
        "--nvrx",
        action="store_true",
        help="faults: nvidia-resiliency-ext's AsyncCallsQueue (and callers) instead of megatron-core's",
    )
    p.add_argument(
        "--fault-bound",
        type=float,
        default=60.0,
        help="faults: seconds of training steps after the fault before the job calls it a stall and stops",
    )
    p.add_argument(
        "--uncaught",
        action="store_true",
        help="faults: the job does not catch the failed save's exception (it ends the job, which must exit)",
    )
    p.add_argument(
        "--abandon",
        choices=["new-queue", "shut-down-manager"],
        default="new-queue",
        help="async-results: how a save is abandoned after its write: a fresh AsyncCallsQueue (an "
        "in-process restart), or that and the results queue's manager shut down (an abort)",
    )
    p.add_argument(
        "--slow-write",
        default="",
        metavar="ITER:SECONDS|ITER:after=OTHER[,...]",
        help="each write of these iterations' files takes SECONDS longer, or ends after OTHER's first (a slow "
        "file system; slow_file_system.py)",
    )
    p.add_argument("--iteration", default="latest", help="resume: which iteration (a number, latest, or all)")
    p.add_argument(
        "--growing-object",
        action="store_true",
        help="a ShardedObject whose pickled size grows with the iteration (a data loader's state)",
    )
    p.add_argument("--device", default="cpu", help="where the state lives (cuda on a GPU machine)")
    p.add_argument("--launch", type=int, metavar="N", help="start N ranks of this job (torchrun-style env)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rank-timeout", type=float, default=900)
    p.add_argument("--pg-timeout", type=float, help="seconds a collective waits for the other ranks")
    return p.parse_args(argv)


# --- the state ------------------------------------------------------------------------------


def global_value(key, shape, iteration, dtype):
    import torch

    numel = 1
    for s in shape:
        numel *= s
    base = torch.arange(numel, dtype=torch.float64).reshape(shape) * 0.25
    return (base + iteration * 10 + zlib.crc32(key.encode()) % 97).to(dtype)


def model_params(rank, world, vocab=None):
    """(key, global shape, dtype, kind): the model-style weights; with a padded ``vocab``, the
    word embeddings have that many rows and an output layer is added, both vocabulary tensors."""
    import torch

    params = [
        ("embedding.word_embeddings.weight", (vocab or VOCAB, HIDDEN), torch.bfloat16, "sharded"),
        ("decoder.layers.mlp.linear_fc1.weight", (LAYERS, HIDDEN, 4), torch.bfloat16, "stacked"),
        ("decoder.final_layernorm.weight", (HIDDEN,), torch.float32, "replicated"),
    ]
    if vocab:
        params.append(("output_layer.weight", (vocab, HIDDEN), torch.bfloat16, "sharded"))
    return params


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def vocabulary_value(key, shape, saved_rows, iteration, dtype):
    """What a vocabulary tensor of ``shape`` holds after a load from ``saved_rows`` rows: the
    saved overlap, zeros elsewhere (megatron-core's allow_shape_mismatch)."""
    import torch

    saved = global_value(key, (saved_rows, *shape[1:]), iteration, dtype)
    full = torch.zeros(shape, dtype=dtype)
    rows = min(saved_rows, shape[0])
    full[:rows] = saved[:rows]
    return full


def model_sharded_tensors(iteration, rank, world, device, zeros=False, args=None):
    """{key: ShardedTensor or list of them (layer-stacked)}: the model state of one rank."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    vocab = getattr(args, "padded_vocab", None)
    saved_vocab = getattr(args, "saved_vocab", None) or vocab
    flexible = {"allow_shape_mismatch": True} if vocab and not getattr(args, "rigid_vocab", False) else {}
    out = {}
    for key, shape, dtype, kind in model_params(rank, world, vocab):
        is_vocab = bool(vocab) and key in VOCAB_KEYS
        if is_vocab and saved_vocab != shape[0]:
            full = vocabulary_value(key, shape, saved_vocab, iteration, dtype)
        else:
            full = global_value(key, shape, iteration, dtype)
        if zeros:
            full = torch.zeros_like(full)
        if kind == "sharded":  # split along dim 0 across the ranks, like a tensor/expert-parallel weight
            rows = shape[0] // world
            local = full[rank * rows : (rank + 1) * rows].clone().to(device)
            extra = flexible if is_vocab else {}
            out[key] = ShardedTensor.from_rank_offsets(key, local, (0, rank, world), replica_id=(0, 0, 0), **extra)
        elif kind == "stacked":  # one tensor per layer, stacked on a prepended axis, replicated
            out[key] = [
                ShardedTensor.from_rank_offsets(
                    key,
                    full[layer].clone().to(device),
                    (0, layer, shape[0]),
                    replica_id=(0, 0, rank),
                    prepend_axis_num=1,
                )
                for layer in range(shape[0])
            ]
        else:  # replicated across the data-parallel ranks
            out[key] = ShardedTensor.from_rank_offsets(key, full.clone().to(device), replica_id=(0, 0, rank))
    return out


def dp_bounds(numel, world, split):
    """Where each data-parallel rank's piece of a flattened buffer starts (uneven, like buckets)."""
    if world == 1:
        return [0, numel]
    share = 0.6 if split == "even" else 0.3
    first = max(1, min(numel - 1, int(numel * share)))
    return [0, first, numel] if world == 2 else [numel * r // world for r in range(world + 1)]


def optimizer_sharded_tensors(iteration, rank, world, device, split, model, zeros=False, whole_1d=False):
    """The distributed optimizer's fully_sharded_model_space state for the ``model`` tensors,
    built the way megatron-core builds it: ``replace`` of the model ShardedTensor with the
    optimizer's key, its flattened piece and a flattened_range. A replicated weight's
    flattened buffer is split unevenly among the data-parallel ranks; the sharded weight's
    data-parallel group is its rank alone (as an expert-parallel weight's), which holds all of it."""
    import torch

    kinds = {key: kind for key, _shape, _dtype, kind in model_params(rank, world)}
    out = {}
    for key, sh_tens in model.items():
        pieces = sh_tens if isinstance(sh_tens, list) else [sh_tens]
        for state in STATES:
            state_key = "optimizer.state.%s.%s" % (state, key)
            full = global_value(state_key, pieces[0].global_shape, iteration, torch.float32)
            states = []
            for piece in pieces:
                local = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
                index = tuple(slice(o, o + s) for o, s in zip(piece.global_offset, local))
                flat = full[index].reshape(piece.local_shape).flatten()
                if kinds[key] == "sharded":
                    mine = (0, flat.numel())
                elif whole_1d and len(piece.global_shape) == 1:
                    if rank != 0:
                        continue  # all of it lies in rank 0's piece of the buffer
                    mine = (0, flat.numel())
                else:
                    bounds = dp_bounds(flat.numel(), world, split)
                    mine = (bounds[rank], bounds[rank + 1])
                data = flat[mine[0] : mine[1]].clone()
                if zeros:
                    data = torch.zeros_like(data)
                states.append(
                    dataclasses.replace(
                        piece,
                        key=state_key,
                        data=data.to(device),
                        dtype=data.dtype,
                        flattened_range=slice(*mine),
                        replica_id=(0, 0, 0),
                    )
                )
            if states:
                out["%s.%s" % (state, key)] = states if isinstance(sh_tens, list) else states[0]
    return out


def rng_state(iteration):
    """Megatron-LM's get_rng_state(): the generators' states, seeded by the iteration so that
    every rank and every later job can rebuild exactly what was saved."""
    import numpy as np
    import torch

    random.seed(iteration)
    np.random.seed(iteration)
    torch.manual_seed(iteration)
    return [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()},
        }
    ]


def training_args(iteration):
    """A few of Megatron-LM's arguments: it keeps the whole argparse.Namespace in common.pt."""
    return argparse.Namespace(
        ckpt_format="torch_dist",
        use_distributed_optimizer=True,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        iteration=iteration,
        lr=1e-4,
        save_interval=1,
    )


def bucket_space_sharded_tensors(iteration, rank, world, device, zeros=False):
    """The distributed optimizer's fully_sharded_bucket_space state, as megatron-core 0.6/0.7's
    sharded_param_state_fs_bucket_space lays it out: per optimizer state, the flattened values
    of the weights of one data-parallel group concatenated into a bucket padded to a multiple
    of the group's size; each rank holds its contiguous share as 1-D ShardedTensors of its
    weights' pieces (``flattened_range`` within the share). The replicated weights form the
    bucket of the group of all ranks; the sharded weight's piece forms a bucket of a group of
    one rank, as an expert-parallel weight's does."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    params = model_params(rank, world)
    groups = [  # (group index, this rank's place in it, its size, its weights)
        (0, rank, world, [(k, s) for k, s, _d, kind in params if kind != "sharded"]),
        (1 + rank, 0, 1, [(k, s) for k, s, _d, kind in params if kind == "sharded"]),
    ]
    out = {}
    for state in STATES:
        for group_idx, group_rank, group_size, members in groups:
            values = []
            for key, shape in members:
                full = global_value("optimizer.state.%s.%s" % (state, key), shape, iteration, torch.float32)
                if group_size == 1:  # the sharded weight: this rank's rows only
                    rows = shape[0] // world
                    full = full[rank * rows : (rank + 1) * rows]
                values.append(full.flatten())
            bounds = [0]
            for value in values:
                bounds.append(bounds[-1] + value.numel())
            local = -(-bounds[-1] // group_size)  # the share of each rank, padding included
            buffer = torch.cat([*values, torch.zeros(local * group_size - bounds[-1])])
            if local * group_size > bounds[-1]:
                bounds.append(local * group_size)  # the padding is a piece of its own
            start, end = group_rank * local, (group_rank + 1) * local
            key = "optimizer.distributed.dp_group_idx_%d.gbuf_idx_0.dtype_torch.float32.bucket_idx_0.%s" % (
                group_idx,
                state,
            )
            pieces = []
            for lo, hi in zip(bounds, bounds[1:]):
                a, b = max(lo, start), min(hi, end)
                if a >= b:
                    continue
                data = buffer[a:b].clone()
                pieces.append(
                    ShardedTensor(
                        key=key,
                        data=(torch.zeros_like(data) if zeros else data).to(device),
                        dtype=torch.float32,
                        local_shape=(local,),
                        global_shape=(local * group_size,),
                        global_offset=(group_rank * local,),
                        axis_fragmentations=(group_size,),
                        flattened_range=slice(a - start, b - start),
                        allow_shape_mismatch=True,
                    )
                )
            out["%s.group_%d" % (state, group_idx)] = pieces
    return out


def full_state(args, iteration, rank, world, zeros=False):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    kind, device = args.state, args.device
    model = model_sharded_tensors(iteration, rank, world, device, zeros, args)
    if kind == "model":
        optimizer = {}
    elif args.optimizer_layout == "bucket":
        optimizer = bucket_space_sharded_tensors(iteration, rank, world, device, zeros)
    else:
        optimizer = optimizer_sharded_tensors(iteration, rank, world, device, args.split, model, zeros, args.whole_1d)
    state = {"optimizer": {"state": optimizer}}
    if kind in ("full", "model"):
        state["model"] = model
        rng = None if zeros else rng_state(iteration)
        state["rng_state"] = ShardedObject("rng_state", rng, (1,), (0,), replica_id=rank)
    if getattr(args, "growing_object", False):
        history = None if zeros else list(range(iteration * 40))
        state["train_history"] = ShardedObject("train_history", history, (1,), (0,), replica_id=rank)
    state["iteration"] = None if zeros else iteration
    state["args"] = None if zeros else training_args(iteration)
    state["optimizer"]["param_groups"] = None if zeros else [{"lr": 1e-4 * iteration, "step": iteration}]
    state["num_floating_point_operations_so_far"] = None if zeros else iteration * 1e12
    return state


def expected_values(args, iteration, rank, world):
    """The plain values a job of this layout must load: the template built with data."""
    import torch

    state = full_state(argparse.Namespace(**dict(vars(args), device="cpu")), iteration, rank, world)

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, list):
            return [plain(v) for v in x]
        data = getattr(x, "data", x)
        if hasattr(x, "key") and not isinstance(data, torch.Tensor):  # ShardedObject
            return data
        return data

    return plain(state)


def compare(expected, loaded, path=""):
    import numpy as np
    import torch

    if isinstance(expected, np.ndarray):
        ok = isinstance(loaded, np.ndarray) and loaded.dtype == expected.dtype
        return [] if ok and np.array_equal(loaded, expected) else [path]
    if isinstance(expected, tuple):
        if not isinstance(loaded, tuple) or len(loaded) != len(expected):
            return [path]
        return [p for i, e in enumerate(expected) for p in compare(e, loaded[i], "%s(%d)" % (path, i))]
    if isinstance(expected, argparse.Namespace):
        return compare(vars(expected), vars(loaded) if isinstance(loaded, argparse.Namespace) else None, path)
    if isinstance(expected, dict):
        out = []
        for k in expected:
            out += compare(expected[k], loaded.get(k) if isinstance(loaded, dict) else None, "%s.%s" % (path, k))
        return out
    if isinstance(expected, list):
        if not isinstance(loaded, list) or len(loaded) != len(expected):
            return [path]
        return [p for i, e in enumerate(expected) for p in compare(e, loaded[i], "%s[%d]" % (path, i))]
    if isinstance(expected, torch.Tensor):
        ok = isinstance(loaded, torch.Tensor) and loaded.dtype == expected.dtype and loaded.shape == expected.shape
        return [] if ok and torch.equal(loaded.cpu(), expected) else [path]
    return [] if expected == loaded else [path]


# --- megatron-core's checkpoint path ----------------------------------------------------------


def iteration_dir(root, iteration):
    return os.path.join(root, "iter_%07d" % iteration)


class Release:
    """What the installed megatron-core has of Megatron-LM's checkpoint path."""

    def __init__(self):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import serialization

        self.async_save = "async_sharded_save" in inspect.signature(dist_checkpointing.save).parameters  # 0.7
        # 0.17: async saves through nvidia-resiliency-ext's strategy by default, or megatron-core's
        self.async_strategy = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
        self.default_strategies = hasattr(serialization, "get_default_save_sharded_strategy")  # 0.7
        try:
            from megatron.core.dist_checkpointing.strategies import fully_parallel  # noqa: F401  (0.7)

            self.fully_parallel = True
        except ImportError:
            self.fully_parallel = False
        try:
            from megatron.core.dist_checkpointing.validation import StrictHandling  # noqa: F401  (0.9)

            self.strict = True
        except ImportError:
            self.strict = False

    def as_dict(self):
        return dict(vars(self))


def make_save_strategy(context, release):
    """As checkpointing.py's save_checkpoint builds it (ckpt_format torch_dist, fully parallel
    save, --ckpt-assume-constant-structure, as far as the release has them), kept in
    ``context`` for the next saves."""
    import torch.distributed as dist

    if "save_strategy" in context:
        return context["save_strategy"], False
    if not release.default_strategies:  # megatron-core 0.6: the format and its version
        context["save_strategy"] = ("torch_dist", 1)
        return context["save_strategy"], True
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    strategy = get_default_save_sharded_strategy("torch_dist")
    if hasattr(strategy, "use_cached_ckpt_structure"):  # 0.8
        strategy.use_cached_ckpt_structure = True
    loaded = getattr(context.get("load_strategy"), "cached_global_metadata", None)
    context["plugged_loaded_metadata"] = loaded is not None
    if loaded is not None:
        strategy.cached_global_metadata = loaded
    if release.fully_parallel:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        strategy = FullyParallelSaveStrategyWrapper(strategy, dist.group.WORLD, True)
    context["save_strategy"] = strategy
    return strategy, True


NVRX_ASYNC = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
ASYNC_STRATEGY = {"name": "nvrx"}  # --async-strategy, for megatron-core 0.17+


def save_kwargs(release):
    """What checkpointing.py passes to dist_checkpointing.save for an async save's strategy (0.17+)."""
    return {"async_strategy": ASYNC_STRATEGY["name"]} if release.async_strategy else {}


def async_queue(persistent, nvrx=False):
    """megatron-core's AsyncCallsQueue, or nvidia-resiliency-ext's (``nvrx``, or megatron-core 0.17+
    with its default async strategy: Megatron-LM then takes the queue of that strategy)."""
    if not nvrx and ASYNC_STRATEGY["name"] == "nvrx":
        from megatron.core import dist_checkpointing

        nvrx = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    if nvrx:
        AsyncCallsQueue = __import__(NVRX_ASYNC, fromlist=["AsyncCallsQueue"]).AsyncCallsQueue
        return AsyncCallsQueue(persistent=persistent)
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if persistent:
        return AsyncCallsQueue(persistent=True)
    return AsyncCallsQueue()


def schedule(queue, request):
    """``queue.schedule_async_request(request)``; nvidia-resiliency-ext's queue gets the request as
    its own AsyncRequest (megatron-core's lacks methods it calls)."""
    if type(queue).__module__ == NVRX_ASYNC:
        request = sys.modules[NVRX_ASYNC].AsyncRequest(**request._asdict())
    return queue.schedule_async_request(request)


def finalize(queue, blocking):
    try:
        return queue.maybe_finalize_async_calls(blocking=blocking, no_dist=False)
    except TypeError:  # megatron-core < 0.12 has no no_dist
        return queue.maybe_finalize_async_calls(blocking=blocking)


def save_one(state, iteration, root, context, queue, rank, release, synchronous=False, change_request=None):
    """One save as checkpointing.py's save_checkpoint makes it; returns once it is scheduled
    (async) or written (synchronous: megatron-core 0.6, or ``synchronous``). ``change_request``:
    what the async request becomes before it is scheduled (the fault scenario's)."""
    from megatron.core import dist_checkpointing

    folder = iteration_dir(root, iteration)
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
    import torch.distributed as dist

    dist.barrier()
    strategy, first = make_save_strategy(context, release)

    def iter_finalize_fn():
        if rank == 0:
            with open(os.path.join(root, TRACKER), "w") as f:
                f.write(str(iteration))

    if not release.async_save or synchronous:  # the save returns when it is written
        dist_checkpointing.save(state, folder, strategy, validate_access_integrity=first)
        dist.barrier()
        iter_finalize_fn()
        return folder
    request = dist_checkpointing.save(
        state, folder, strategy, async_sharded_save=True, validate_access_integrity=first, **save_kwargs(release)
    )
    request.add_finalize_fn(iter_finalize_fn)
    schedule(queue, change_request(request) if change_request else request)
    return folder


def save_and_finalize(state, iteration, root, context, queue, rank, release):
    """A save, then training steps until it is finalized (before the next save)."""
    folder = save_one(state, iteration, root, context, queue, rank, release)
    if queue is None:
        return folder
    steps = 0
    while finalize(queue, blocking=False) == [] and steps < 200:  # training steps go on meanwhile
        time.sleep(0.05)
        steps += 1
    finalize(queue, blocking=True)  # before the next save (overlapping saves share one results queue)
    return folder


def base_strategy(wrapper):
    return getattr(wrapper, "base_strategy", wrapper)


def describe_metadata(folder):
    """The unpickled .metadata, as plain data the tests compare across torch releases."""
    classes = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            classes.add("%s.%s" % (module, name))
            return super().find_class(module, name)

    with open(os.path.join(folder, ".metadata"), "rb") as f:
        md = Recording(io.BytesIO(f.read())).load()

    def entry(e):
        if not hasattr(e, "chunks"):
            return "bytes"
        chunks = sorted([list(c.offsets), list(c.sizes)] for c in e.chunks)
        return {"size": list(e.size), "chunks": chunks, "dtype": str(e.properties.dtype)}

    storage = {}
    for index, info in (md.storage_data or {}).items():
        name = "%s|%s|%s" % (index.fqn, list(index.offset) if index.offset is not None else None, index.index)
        storage[name] = [str(info.relative_path), info.offset, info.length]
    mcore = getattr(md, "mcore_data", None)
    plans = getattr(md, "all_local_plans", None)
    return {
        "state_dict_metadata": {k: entry(v) for k, v in sorted(md.state_dict_metadata.items())},
        "storage_data": storage,
        "planner_data": repr(md.planner_data),
        "mcore_data": None
        if mcore is None
        else {k: {n: list(s) for n, s in sorted(v.items())} for k, v in sorted(mcore.items())},
        "all_local_plans": None if plans is None else len(plans),
        "classes": sorted(classes),
        "distcp": {
            name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))
            if name.endswith(".distcp")
        },
    }


def init(args):
    import torch.distributed as dist

    timeout = {"timeout": datetime.timedelta(seconds=args.pg_timeout)} if args.pg_timeout else {}
    dist.init_process_group("gloo", **timeout)
    return dist.get_rank(), dist.get_world_size()


def save_job(args, result):
    rank, world = init(args)
    release = Release()
    result["release"] = release.as_dict()
    context = {}
    queue = async_queue(args.persistent) if release.async_save else None
    try:
        for iteration in range(1, args.iterations + 1):
            state = full_state(args, iteration, rank, world)
            save_and_finalize(state, iteration, args.root, context, queue, rank, release)
            result.setdefault("saved", []).append(iteration)
    finally:
        if queue is not None:
            finalize(queue, blocking=True)
            if hasattr(queue, "close"):
                queue.close()
    base = base_strategy(context["save_strategy"])
    # None where the release has no cached structure (0.6, 0.7)
    result["cached_structure_reused"] = (
        bool(getattr(base, "validated_cache_reuse", False)) if hasattr(base, "use_cached_ckpt_structure") else None
    )
    if rank == 0:
        result["metadata"] = describe_metadata(iteration_dir(args.root, args.iterations))


def training_steps(queue, finalized, until_empty=True, steps=400):
    """Megatron-LM's loop: every iteration finalizes what is done, never waiting."""
    for _ in range(steps):
        finalized.extend(finalize(queue, blocking=False) or [])
        if not until_empty or queue.get_num_unfinalized_calls() == 0:
            return
        time.sleep(0.05)
    raise RuntimeError("saves still unfinalized after %d training steps" % steps)


def wait_for_write_without_finalizing(queue):
    """Until the last scheduled save's write is done on every rank; it is not finalized."""
    caller = queue.async_calls[-1].async_caller
    if "no_dist" in inspect.signature(caller.is_current_async_call_done).parameters:
        while not caller.is_current_async_call_done(blocking=True, no_dist=False):
            pass
    else:
        while not caller.is_current_async_call_done(blocking=True):
            pass


def abandon(queue, how, persistent):
    """The queue's unfinalized save is abandoned, as an in-process restart or an abort leaves
    it; a new AsyncCallsQueue takes the next saves."""
    close = getattr(queue, "close", None)
    if close is not None and "abort" in inspect.signature(close).parameters:
        close(abort=True)
    else:
        queue.async_calls.clear()  # nothing will finalize it
    if how == "shut-down-manager":  # as an abort that shuts the results queue's manager down
        fs = sys.modules["megatron.core.dist_checkpointing.strategies.filesystem_async"]
        shared = getattr(fs, "_results_queue", None)
        if shared is not None and getattr(shared, "_manager", None) is not None:
            shared._manager.shutdown()
    return async_queue(persistent)


def async_results_job(args, result):
    """Saves as Megatron-LM's loop can make them, each in its own iteration folder:

    1, 2: save 2 starts before save 1 has finished (save 1's write is slow), as Megatron-LM
          allows ("Starting a checkpoint save before previous has finished"); training steps
          finalize both, in call order, without waiting;
    3, 4: save 4 is synchronous, made while save 3 is in flight (save 4's write is slow);
    5, 6: save 5 is abandoned after its write (a new AsyncCallsQueue, as after an in-process
          restart or an abort); save 6 follows.

    Every save reports success here; whether each checkpoint holds its own state is for the
    resume (``resume --iteration all``) to tell."""
    rank, world = init(args)
    release = Release()
    result["release"] = release.as_dict()
    context = {}
    queue = async_queue(args.persistent)
    finalized = []
    events = result.setdefault("events", [])

    def save(iteration, synchronous=False):
        state = full_state(args, iteration, rank, world)
        save_one(state, iteration, args.root, context, queue, rank, release, synchronous=synchronous)
        events.append("%s %d" % ("saved" if synchronous else "scheduled", iteration))

    try:
        save(1)
        training_steps(queue, finalized, until_empty=False, steps=1)
        save(2)
        training_steps(queue, finalized)
        events.append("finalized 1, 2")
        save(3)
        save(4, synchronous=True)
        training_steps(queue, finalized)
        events.append("finalized 3")
        save(5)
        wait_for_write_without_finalizing(queue)
        queue = abandon(queue, args.abandon, args.persistent)
        events.append("abandoned 5 (%s)" % args.abandon)
        save(6)
        training_steps(queue, finalized)
        events.append("finalized 6")
    except BaseException:
        queue.async_calls.clear()  # a failed finalize ends the job, as it ends Megatron-LM's
        raise
    finally:
        result["finalized_calls"] = len(finalized)
    queue.close()


# Megatron-LM keeps its AsyncCallsQueue in a module global (megatron/training/async_utils.py):
# whatever it holds is still referenced when the interpreter exits.
_async_calls_queue = None


def raise_in_preload(*_args, **_kwargs):
    """The fault scenario's preload_fn on the faulty rank (importable: the persistent worker is spawned)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import faulty_writes

    faulty_writes.record_fault_time(os.environ["JOB_FAULT_ROOT"])
    raise RuntimeError("preload_fn failed (injected by the test)")


FAULT_WAIT_S = 240.0  # for the fault to happen at all: the persistent worker's spawn is slow on a busy machine


def fault_time(root):
    try:
        with open(os.path.join(root, ".fault-time")) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def fault_bound_passed(args, started):
    """``--fault-bound`` seconds since the fault, or ``FAULT_WAIT_S`` since the save began without
    one (a fault that never happened is a failure of the test, not a stall)."""
    when = fault_time(args.root)
    if when is None:
        return time.time() - started >= FAULT_WAIT_S
    return time.time() - when >= args.fault_bound


def schedule_faulty_save(state, iteration, args, context, queue, rank, release, faulty):
    """Save ``iteration`` as save_checkpoint does (scheduled, then Megatron-LM's barrier), with
    ``args.fault`` on this rank when ``faulty``."""
    import torch.distributed as dist

    def with_fault(request):
        if faulty and args.fault == "preload-raises":
            if getattr(request, "preload_fn", None) is None:
                raise SystemExit("--fault preload-raises: this release's async requests have no preload_fn")
            return request._replace(preload_fn=raise_in_preload)
        return request

    save_one(state, iteration, args.root, context, queue, rank, release, change_request=with_fault)
    if faulty and args.fault in ("async-process-kill", "worker-kill"):
        process = queue.async_calls[-1].async_caller.process
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import faulty_writes

        faulty_writes.record_fault_time(args.root)
        os.kill(process.pid, 9)
    dist.barrier()  # checkpointing.py's, right after scheduling


def faults_job(args, result):
    """Save 2 with ``--fault`` on ``--fault-rank``; training steps (a non-blocking finalize each)
    until the failed save raises on this rank, or ``--fault-bound`` seconds pass (a stall); then
    the job goes on as one that catches the exception: save 3, finalized, loaded back and
    compared; or, with ``--uncaught``, save 1 comes first and the failure ends the job."""
    global _async_calls_queue
    rank, world = init(args)
    result["rank"] = rank
    release = Release()
    result["release"] = release.as_dict()
    context = {}
    queue = _async_calls_queue = async_queue(args.persistent, args.nvrx)
    faulty = rank == args.fault_rank
    os.environ["JOB_FAULT_ROOT"] = args.root
    result["saved"] = []
    if args.uncaught:  # a job that ends with the failure resumes from the save before it
        save_and_finalize(full_state(args, 1, rank, world), 1, args.root, context, queue, rank, release)
        result["saved"].append(1)
    started = time.time()
    schedule_faulty_save(full_state(args, 2, rank, world), 2, args, context, queue, rank, release, faulty)
    raised = None
    try:  # the bound counts from the fault (recorded by whoever met it), not from a slow start
        while not fault_bound_passed(args, started):
            finalize(queue, blocking=False)
            if queue.get_num_unfinalized_calls() == 0:
                break
            time.sleep(0.05)
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        raised = exc
    now = time.time()
    when = fault_time(args.root)
    result["fault_to_raise_s"] = None if raised is None or when is None else round(now - when, 3)
    result["raised"] = None if raised is None else {"type": type(raised).__name__, "message": str(raised)[-3000:]}
    result["unfinalized"] = queue.get_num_unfinalized_calls()
    if raised is None:
        result["stalled"] = queue.get_num_unfinalized_calls() > 0
        when = fault_time(args.root)
        result["error"] = (
            "the fault never happened" if when is None else "no rank raised %.0f s after the fault" % args.fault_bound
        )
        result["loaded_equal"] = False
        return
    if args.uncaught:
        raise raised
    save_and_finalize(full_state(args, 3, rank, world), 3, args.root, context, queue, rank, release)
    result["saved"].append(3)
    mismatched, _strategy = load_iteration(args, 3, rank, world, release)
    result["loaded_equal"] = not mismatched
    # The end of training: maybe_finalize_async_save(blocking=True, terminate=True).
    finalize(queue, blocking=True)
    if hasattr(queue, "close"):
        queue.close()


def load_iteration(args, iteration, rank, world, release):
    """Load one iteration into a zeroed template as Megatron-LM's resume does; (what differs
    from what that iteration saved, the load strategy)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    folder = iteration_dir(args.root, iteration)
    template = full_state(args, iteration, rank, world, zeros=True)
    strategy = None
    if release.fully_parallel and not args.plain_load:
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(folder), dist.group.WORLD)
    kwargs = {}
    if release.strict:
        from megatron.core.dist_checkpointing.validation import StrictHandling

        kwargs["strict"] = StrictHandling(args.strict)
    elif args.strict != "assume_ok_unexpected":
        raise SystemExit("--strict %s: this megatron-core has no StrictHandling" % args.strict)
    loaded = dist_checkpointing.load(template, folder, strategy, **kwargs)
    return compare(expected_values(args, iteration, rank, world), loaded), strategy


def resume_every_iteration(args, result):
    """``resume --iteration all``: every iteration folder of the job, loaded and compared."""
    import torch.distributed as dist

    rank, world = init(args)
    release = Release()
    result["release"] = release.as_dict()
    found = sorted(int(name[len("iter_") :]) for name in os.listdir(args.root) if name.startswith("iter_"))
    iterations = result.setdefault("iterations", {})
    for iteration in found:
        entry = iterations.setdefault(str(iteration), {})
        entry["metadata"] = os.path.exists(os.path.join(iteration_dir(args.root, iteration), ".metadata"))
        if not entry["metadata"]:
            continue
        try:
            mismatched, _strategy = load_iteration(args, iteration, rank, world, release)
            entry["loaded_equal"] = not mismatched
            entry["mismatched"] = mismatched[:5]
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            entry["loaded_equal"] = False
            entry["error"] = "%s: %s" % (type(exc).__name__, str(exc)[-700:])
        dist.barrier()
    result["loaded_equal"] = all(e.get("loaded_equal", not e["metadata"]) for e in iterations.values())


def read_metadata(folder):
    """What megatron-core says a checkpoint holds without loading it: {reader: {key: global shape}}
    for load_tensors_metadata and (0.8+) load_sharded_metadata, or the error each raised."""
    from megatron.core.dist_checkpointing import serialization

    out = {}
    for name in ("load_tensors_metadata", "load_sharded_metadata"):
        reader = getattr(serialization, name, None)
        if reader is None:
            continue
        try:
            described = reader(folder)
            out[name] = {
                key: list(getattr(value, "global_shape", ()) or ())
                for key, value in sorted(described.items())
                if hasattr(value, "flattened_range")  # the ShardedTensors (not the ShardedObjects)
            }
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            out[name] = {"error": "%s: %s" % (type(exc).__name__, str(exc)[-700:])}
    return out


def expected_shapes(args, rank, world):
    """{key: global shape} of every ShardedTensor the job saves (N-D, as saved before flattening)."""
    state = full_state(argparse.Namespace(**dict(vars(args), device="cpu")), 1, rank, world)
    shapes = {}

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif hasattr(x, "global_shape") and hasattr(x, "flattened_range"):
            shapes[x.key] = list(x.global_shape)

    walk(state)
    return shapes


def resume_job(args, result):
    from megatron.core import dist_checkpointing

    rank, world = init(args)
    release = Release()
    result["release"] = release.as_dict()
    with open(os.path.join(args.root, TRACKER)) as f:
        iteration = int(f.read().strip())
    folder = iteration_dir(args.root, iteration)
    common = dist_checkpointing.load_common_state_dict(folder)  # what the rank-0 path reads first
    result["iteration"] = iteration
    result["common_iteration"] = common.get("iteration")
    result["common_args"] = compare({"args": training_args(iteration)}, {"args": common.get("args")}) == []
    mismatched, strategy = load_iteration(args, iteration, rank, world, release)
    result["mismatched"] = mismatched
    result["loaded_equal"] = not mismatched and result["common_args"]
    if args.read_metadata:
        described = read_metadata(folder)
        expected = expected_shapes(args, rank, world)
        # Each rank's request holds its own keys (a sharded weight's optimizer bucket is one rank's):
        # each must be described with the global shape it was saved with.
        result["metadata_reads"] = {
            name: shapes.get("error") or [k for k in sorted(expected) if shapes.get(k) != expected[k]] or True
            for name, shapes in described.items()
        }
        result["loaded_equal"] = result["loaded_equal"] and all(v is True for v in result["metadata_reads"].values())
    if args.then_save:
        context = {"load_strategy": strategy}
        queue = async_queue(False) if release.async_save else None
        try:
            state = full_state(args, iteration + 1, rank, world)
            save_and_finalize(state, iteration + 1, args.root, context, queue, rank, release)
        finally:
            if queue is not None:
                finalize(queue, blocking=True)
        result["plugged_loaded_metadata"] = context.get("plugged_loaded_metadata", False)
        result["loaded_metadata_reused"] = bool(
            getattr(base_strategy(context["save_strategy"]), "validated_loaded_metadata_reuse", False)
        )


def stack_report():
    """What this process's numpy, torch and pkg_resources look like once the job ran: whatever
    an installed package did inside megatron-core must not show here."""
    import numpy
    import torch

    report = {"numpy_has_product": hasattr(numpy, "product")}
    buffer = io.BytesIO()
    torch.save(argparse.Namespace(probe=1), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer)
        report["torch_load_refuses_namespace"] = False
    except Exception as exc:
        report["torch_load_refuses_namespace"] = "Weights only load failed" in str(exc)
    try:
        import pkg_resources

        report["pkg_resources"] = "importable"
        report["pkg_resources_has_packaging"] = hasattr(pkg_resources, "packaging")
    except ImportError:
        report["pkg_resources"] = "missing"
    report["pkg_resources_packaging_module"] = "pkg_resources.packaging" in sys.modules
    return report


def job(args):
    result = {"pid": os.getpid(), "ok": False, "error": None, "phase": args.phase}
    warnings.simplefilter("ignore")
    try:
        import numpy
        import torch

        result["torch"] = torch.__version__
        result["numpy"] = numpy.__version__
        ASYNC_STRATEGY["name"] = args.async_strategy
        result["python"] = platform.python_version()
        if args.slow_write:  # before any write process is forked or spawned
            os.environ["JOB_SLOW_WRITES"] = args.slow_write
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import slow_file_system

            slow_file_system.install(args.slow_write, args.root)
        if args.fault in ("writer-sigkill", "writer-segfault", "enospc") and os.environ.get("RANK") == str(
            args.fault_rank
        ):
            os.environ["JOB_FAULTY_WRITES"] = "2:%s" % args.fault
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import faulty_writes

            faulty_writes.install(os.environ["JOB_FAULTY_WRITES"])
        if args.phase == "save":
            scenarios = {"async-results": async_results_job, "faults": faults_job}
            scenarios.get(args.scenario, save_job)(args, result)
        elif args.iteration == "all":
            resume_every_iteration(args, result)
        else:
            resume_job(args, result)
        result["ok"] = result.get("loaded_equal", True)
    except BaseException as exc:  # reported to the test as data
        result["error"] = "%s: %s" % (type(exc).__name__, exc)
        result["traceback"] = traceback.format_exc()
    try:
        result["stack"] = stack_report()
    except Exception as exc:
        result["stack"] = {"error": "%s: %s" % (type(exc).__name__, exc)}
    stand_in = sys.modules.get("cpu_stand_in_for_cuda")
    result["cuda_stand_in_sites"] = dict(stand_in.SITES) if stand_in else None
    return result


# --- launching ranks --------------------------------------------------------------------------


def launch(args, argv):
    """``args.launch`` ranks of this job, as examples/checkpoint_job.py starts them."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
    from checkpoint_job import run_ranks, without_launch

    child = [a for a in without_launch(argv) if a != "--json"]
    ranks = run_ranks(__file__, child, args.launch, args.rank_timeout)
    return {
        "ok": all(r.get("ok") for r in ranks),
        "error": next((r["error"] for r in ranks if r.get("error")), None),
        "ranks": ranks,
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = launch(args, argv) if args.launch else job(args)
    if args.json:
        print(json.dumps(result, sort_keys=True, default=str))
    else:
        print("ok" if result["ok"] else "FAILED: %s" % result["error"])
    if result.get("stalled"):  # a stalled save's processes would keep this one from exiting
        sys.stdout.flush()
        os._exit(3)
    return 0 if result["ok"] else 1


if __name__ == "__main__":  # spawned workers re-import this file
    sys.exit(main())
