"""A stand-in for a training job: one megatron-core torch_dist checkpoint, saved and loaded.

It never imports mcore_autopatch: whether the save works depends only on what is
installed in the environment, exactly as for a real job. Used by `make demo`, the
end-to-end tests and the benchmarks.

    python examples/checkpoint_job.py                      # async save, execute_sync(), load
    python examples/checkpoint_job.py --json               # one JSON line, for tests
    python examples/checkpoint_job.py --launch 2           # two gloo ranks, torchrun-style env
    python examples/checkpoint_job.py --worker persistent  # save runs in a spawned worker

Ranks: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT when set (torchrun), else one rank
with a file store in the checkpoint folder (no network).
"""

import argparse
import atexit
import hashlib
import inspect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="checkpoint folder (default: a temporary one, removed at the end)")
    p.add_argument(
        "--state",
        choices=["basic", "rich", "large"],
        default="basic",
        help="basic: one float32 tensor; rich: every dtype, a view, objects; large: --mib of float32",
    )
    p.add_argument("--mib", type=int, default=256, help="size of the 'large' state in MiB")
    p.add_argument("--thread-count", type=int, help="write workers per rank (TorchDistSaveShardedStrategy)")
    p.add_argument(
        "--worker",
        choices=["sync", "spawn", "forkserver", "persistent"],
        default="sync",
        help="where the async save function runs: execute_sync() here, or a process of that kind",
    )
    p.add_argument("--launch", type=int, metavar="N", help="start N ranks of this script (torchrun-style env)")
    p.add_argument("--no-load", action="store_true", help="save only")
    p.add_argument("--fail-fsync", action="store_true", help="make os.fsync fail in the writer (a failing disk)")
    p.add_argument("--json", action="store_true", help="print one JSON line with the result")
    p.add_argument("--rank-timeout", type=float, default=600, help="with --launch: seconds to wait for the ranks")
    return p.parse_args(argv)


def init_distributed(folder):
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")  # env:// (MASTER_ADDR, MASTER_PORT)
    else:
        # A file store beside (not inside) the checkpoint folder: megatron-core treats any
        # file it finds in the folder as an old checkpoint.
        store_dir = tempfile.mkdtemp(prefix="ckpt-job-store-")
        atexit.register(shutil.rmtree, store_dir, True)
        store = os.path.join(store_dir, "store")
        dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def make_state(kind, rank, world, mib=256):
    """(sharded state dict to save, template to load into, expected plain values)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(1234)
    if kind == "large":
        rows = mib * 1024 * 1024 // 4 // 1024
        tensors = {"large.weight": torch.randn(rows, 1024, generator=g)}
    else:
        # Each rank holds rows [4*rank, 4*rank+4) of a (4*world, 16) global tensor.
        full = torch.randn(4 * world, 16, generator=g)
        tensors = {"model.weight": full[4 * rank : 4 * rank + 4].clone()}
        if kind == "rich":
            full_bf16 = torch.randn(4 * world, 8, generator=g).to(torch.bfloat16)
            tensors.update(
                {
                    "model.bf16": full_bf16[4 * rank : 4 * rank + 4].clone(),
                    "model.fp16": (torch.randn(4 * world, 8, generator=g) * 3)
                    .to(torch.float16)[4 * rank : 4 * rank + 4]
                    .clone(),
                    "model.int64": torch.arange(4 * world * 5, dtype=torch.int64)
                    .reshape(4 * world, 5)[4 * rank : 4 * rank + 4]
                    .clone(),
                    "model.uint8": torch.randint(0, 256, (4 * world, 7), dtype=torch.uint8, generator=g)[
                        4 * rank : 4 * rank + 4
                    ].clone(),
                    "model.bool": (torch.randn(4 * world, 9, generator=g) > 0)[4 * rank : 4 * rank + 4].clone(),
                    # A non-contiguous view (every other column, transposed), saved as is.
                    "model.view": torch.randn(4 * world, 12, generator=g)[4 * rank : 4 * rank + 4, ::2].t(),
                }
            )
    sharded, template = {}, {}
    for key, local in tensors.items():
        if key == "model.view":
            # The view's global shape is (6, 4*world), sharded along axis 1.
            offsets = (1, rank, world)
        else:
            offsets = (0, rank, world)
        sharded[key] = ShardedTensor.from_rank_offsets(key, local, offsets, replica_id=0)
        template[key] = ShardedTensor.from_rank_offsets(
            key, torch.zeros_like(local).contiguous(), offsets, replica_id=0
        )
    expected = {key: t.clone() for key, t in tensors.items()}
    if kind == "rich":
        objects = {"step": 1234 + rank, "nested": {"lr": 0.5, "betas": [0.9, 0.95], "name": "rank%d" % rank}}
        sharded["optimizer.extra"] = ShardedObject("optimizer.extra", objects, (world,), (rank,), replica_id=0)
        template["optimizer.extra"] = ShardedObject("optimizer.extra", None, (world,), (rank,), replica_id=0)
        expected["optimizer.extra"] = objects
        common = {"iteration": 42, "args": {"seq_length": 2048, "nested": {"flags": [True, False]}}}
        sharded["common"] = common
        template["common"] = None
        expected["common"] = common
    return sharded, template, expected


def save_strategy(thread_count):
    if thread_count is None:
        return None
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=thread_count)


def run_request(request, worker):
    """Run an AsyncRequest's save function where ``worker`` says, then finalize it here."""
    import torch
    import torch.distributed as dist

    if worker == "sync":
        request.execute_sync()
        return {}
    import multiprocessing as mp

    info = {}
    kwargs = dict(getattr(request, "async_fn_kwargs", None) or {})
    if worker == "persistent":
        try:
            from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
        except ImportError:
            PersistentAsyncCaller = None
        if PersistentAsyncCaller is None:
            raise RuntimeError("this megatron-core release has no PersistentAsyncCaller (added in 0.12)")
        # megatron's own persistent checkpoint worker: a spawned process that unpickles
        # the request and imports megatron afresh.
        caller = PersistentAsyncCaller()
        try:
            # As AsyncCallsQueue does: the finalize functions stay in this process.
            queued = request.freeze()._replace(call_idx=0, finalize_fns=[])
            if not torch.cuda.is_available():
                # The preload step copies tensors from the GPU and calls
                # torch.cuda.synchronize(); on the CPU they are on the host already.
                queued = queued._replace(preload_fn=None)
            caller.schedule_async_call(queued)
            caller.is_current_async_call_done(blocking=True, no_dist=True)
        finally:
            caller.close()
        dist.barrier()
        for finalize in request.finalize_fns:
            finalize()
        return {"persistent_caller": "megatron"}
    if request.async_fn is not None:
        process = mp.get_context(worker).Process(
            target=request.async_fn, args=tuple(request.async_fn_args), kwargs=kwargs
        )
        process.start()
        process.join()
        info["worker_exitcode"] = process.exitcode
    dist.barrier()
    for finalize in request.finalize_fns:
        finalize()
    return info


def equal(a, b):
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def file_digests(folder, rank):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".distcp") and name.startswith("__%d_" % rank):
            with open(os.path.join(folder, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def write_item_replaced():
    """Whether the writer module's _write_item is mcore-autopatch's (read, not imported)."""
    writer = sys.modules.get(WRITER)
    return bool(writer is not None and getattr(getattr(writer, "_write_item", None), "__mcore_autopatch__", False))


def job(args):
    result = {"pid": os.getpid(), "ok": False, "error": None}
    folder = args.dir
    os.makedirs(folder, exist_ok=True)
    result["dir"] = folder
    warnings.simplefilter("ignore", FutureWarning)  # torch's ShardedTensor deprecation notice
    import torch
    from megatron.core import dist_checkpointing

    result["torch"] = torch.__version__
    rank, world = init_distributed(folder)
    result.update(rank=rank, world_size=world)
    if args.fail_fsync:

        def failing_fsync(fd):
            raise OSError(5, "Input/output error (injected by checkpoint_job --fail-fsync)")

        os.fsync = failing_fsync
    sharded, template, expected = make_state(args.state, rank, world, args.mib)
    started = time.perf_counter()
    try:
        if "async_sharded_save" in inspect.signature(dist_checkpointing.save).parameters:
            request = dist_checkpointing.save(
                sharded, folder, sharded_strategy=save_strategy(args.thread_count), async_sharded_save=True
            )
            result["write_item_replaced"] = write_item_replaced()
            result.update(run_request(request, args.worker))
        else:  # megatron-core 0.6: synchronous saves only, and zarr by default
            strategy = save_strategy(args.thread_count) or ("torch_dist", 1)
            dist_checkpointing.save(sharded, folder, sharded_strategy=strategy)
            result["write_item_replaced"] = write_item_replaced()
    except Exception as exc:
        result["error"] = "%s: %s" % (type(exc).__name__, exc)
        result["traceback"] = traceback.format_exc()
        result.setdefault("write_item_replaced", write_item_replaced())  # a synchronous save raised
        result["metadata_written"] = os.path.exists(os.path.join(folder, ".metadata"))
        return result
    result["save_seconds"] = time.perf_counter() - started
    result["files"] = file_digests(folder, rank)
    result["metadata_written"] = os.path.exists(os.path.join(folder, ".metadata"))
    if not args.no_load:
        loaded = dist_checkpointing.load(template, folder)
        mismatched = sorted(key for key, value in expected.items() if not equal(value, loaded.get(key)))
        result["loaded_equal"] = not mismatched
        result["mismatched"] = mismatched
    result["ok"] = result.get("loaded_equal", True)
    return result


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_launch(argv):
    """``argv`` without its ``--launch N`` / ``--launch=N`` option."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--launch":
            skip = True
        elif not arg.startswith("--launch="):
            out.append(arg)
    return out


def run_ranks(script, child_argv, count, timeout):
    """Start ``count`` ranks of ``script`` with ``child_argv`` (torchrun-style environment)
    and return each rank's last JSON line (tests/job_path/training_job.py uses it too)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(count))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(script), *child_argv, "--json"],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            start_new_session=True,  # a rank that must be stopped is stopped with what it started
        )
        for r in range(count)
    ]
    ranks = []
    deadline = time.monotonic() + timeout
    try:
        for r, p in enumerate(procs):
            try:  # a rank prints one line: waiting before reading cannot fill the pipe
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
                exited = True
            except subprocess.TimeoutExpired:  # what it printed before it was stopped still counts
                exited = False
            stop(p)  # and whatever it left running, which would hold its stdout open
            out, _ = p.communicate()
            lines = [ln for ln in out.decode().splitlines() if ln.startswith("{")]
            rank = json.loads(lines[-1]) if lines else {"ok": False, "error": "rank %d %s" % (r, ended(p.returncode))}
            rank["exited"] = exited
            if not exited:
                rank["ok"] = False
                rank["error"] = rank.get("error") or "rank %d did not exit within %s s" % (r, timeout)
            ranks.append(rank)
    finally:
        for p in procs:
            stop(p)
    return ranks


def ended(returncode):
    """How a rank's process ended, in words ("exited with code 3", "was killed by SIGKILL")."""
    if returncode is not None and returncode < 0:
        try:
            return "was killed by %s" % signal.Signals(-returncode).name
        except ValueError:
            return "was killed by signal %d" % -returncode
    return "exited with code %s" % returncode


def stop(process):
    """Kill a rank and every process it started (they hold its stdout open)."""
    try:
        os.killpg(process.pid, 9)
    except OSError:
        pass
    process.wait()


def launch(args, argv):
    """Start ``args.launch`` ranks of this script, torchrun-style, and merge their results."""
    child_argv = [a for a in without_launch(argv) if a != "--json"]
    ranks = run_ranks(__file__, [*child_argv, "--dir", args.dir], args.launch, args.rank_timeout)
    return {
        "ok": all(r["ok"] for r in ranks),
        "error": next((r["error"] for r in ranks if r["error"]), None),
        "ranks": ranks,
        "dir": args.dir,
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    temporary = args.dir is None
    if temporary:
        args.dir = tempfile.mkdtemp(prefix="ckpt-job-")
    try:
        result = launch(args, argv) if args.launch else job(args)
    finally:
        if temporary:
            shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    elif result["ok"]:
        print("checkpoint saved and loaded back equal (%s)" % ("in a temporary folder" if temporary else args.dir))
    else:
        print("checkpoint save FAILED: %s" % result["error"])
    return 0 if result["ok"] else 1


if __name__ == "__main__":  # spawned and forkserver workers re-import this file
    sys.exit(main())
