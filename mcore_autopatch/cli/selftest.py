"""``mcore-autopatch selftest``: a real, tiny megatron-core async checkpoint save and load.

One gloo rank with an in-memory store (no network, no GPU needed), a temporary folder,
``dist_checkpointing.save(..., async_sharded_save=True)`` then ``execute_sync()`` (the
write a training job's async worker does), then ``dist_checkpointing.load`` and an exact
comparison; twice: a plain tensor, then a weight with its distributed-optimizer state (an
N-D flattened tensor), whose checkpoint must also keep megatron-core's ``mcore_data``. Then
two async saves in flight at once, the second's write done first and both finalized in call
order, as Megatron-LM's loop finalizes them: each must load back its own state.
It runs megatron-core's own writer through the normal import system, so the
fix is in play exactly when it would be in a job started the same way. With the fix
switched off on an affected stack it fails the way training jobs fail, and says so.

Exit codes: 0 every round trip is equal, 1 one failed, 2 it cannot run here (torch or
megatron-core missing, or a megatron-core whose save path needs CUDA on a CPU machine).
stdout carries one line, the verdict (``selftest: passed`` / ``FAILED: ...`` / ``cannot
run: ...``); what it does and how long each step took go to stderr.
"""

import contextlib
import importlib
import inspect
import os
import sys
import tempfile
import time
from typing import Any, Iterator, Optional, TextIO

from mcore_autopatch import IMPORTER_MODULE, WRITER_MODULE

PASSED, FAILED, CANNOT_RUN = 0, 1, 2
KEY = "mcore_autopatch.cli.selftest.weight"

_YES_NO = {True: "yes", False: "no", None: "cannot tell"}


def _say(out: TextIO, message: str) -> None:
    print("selftest: %s" % message, file=out, flush=True)


class _Streams:
    """Progress and timings go to stderr at once; the verdict is kept for stdout, written once
    torch and megatron-core are done (they may print on file descriptor 1 themselves)."""

    def __init__(self, err: TextIO) -> None:
        self.err = err
        self.said = ""

    def progress(self, message: str) -> None:
        _say(self.err, message)

    def verdict(self, message: str) -> None:
        self.said = message


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """While torch works, what it (or gloo, from C++) writes to file descriptor 1 goes to
    stderr: torch 2.9's gloo prints "[Gloo] Rank 0 is connected to 0 peer ranks" there."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError):  # no real descriptors (a test's stream): nothing to protect
        yield
        return
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _needs_cuda(exc: BaseException, torch: Any) -> bool:
    """A save path that asks for CUDA (megatron-core 0.16+) on a machine without it."""
    return "CUDA" in str(exc) and not torch.cuda.is_available()


def run(out: Optional[TextIO] = None, folder: Optional[str] = None, err: Optional[TextIO] = None) -> int:
    streams = _Streams(err or sys.stderr)
    with _native_stdout_to_stderr():
        code = _run(streams, folder)
    _say(out or sys.stdout, streams.said)
    return code


def _run(streams: _Streams, folder: Optional[str]) -> int:
    started = time.perf_counter()
    try:
        from mcore_autopatch.cli.report import quiet_imports

        with quiet_imports():
            import torch
            import torch.distributed as dist
            from megatron.core import dist_checkpointing

            # The save would import the writer later; importing it now, the same way, lets
            # the report below say what the save is about to run.
            importlib.import_module(WRITER_MODULE)
            importlib.import_module(IMPORTER_MODULE)  # megatron-core's planner and loader: the mcore_data fixes
    except Exception as exc:
        streams.verdict("cannot run: %s: %s" % (type(exc).__name__, exc))
        return CANNOT_RUN

    from mcore_autopatch.cli import report

    info = report.status()  # the writer module is imported now: this is the fixes' state for the save
    streams.progress(
        "torch %s, megatron-core %s; fix needed: %s, applied: %s (%s)"
        % (info["torch"], info["megatron_core"], _YES_NO[info["needed"]], _YES_NO[info["applied"]], info["reason"]),
    )
    others = [r for r in info.get("fixes", []) if r["library"] == "megatron-core" and r["fix"] != "write_item"]
    if others:
        streams.progress(
            "; ".join(
                "%s needed: %s, applied: %s" % (r["fix"], _YES_NO[r["needed"]], _YES_NO[r["applied"]]) for r in others
            ),
        )
    own_group = not dist.is_initialized()
    if own_group:
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        except Exception as exc:  # e.g. a hostname gloo cannot resolve inside a build sandbox
            streams.verdict(
                "cannot run: gloo did not start (%s: %s); try GLOO_SOCKET_IFNAME=lo" % (type(exc).__name__, exc)
            )
            return CANNOT_RUN
    try:
        with quiet_imports():
            for name, build in (("plain", _plain_state), ("distributed-optimizer-style", _optimizer_state)):
                code = _round_trip(streams, name, build, torch, dist_checkpointing, info, folder)
                if code != PASSED:
                    return code
            code = _overlapping_saves(streams, torch, dist_checkpointing, folder)
            if code != PASSED:
                return code
    finally:
        if own_group:
            dist.destroy_process_group()
    streams.progress("the round trips took %.2f s" % (time.perf_counter() - started))
    streams.verdict(
        "passed: plain and distributed-optimizer-style states, and two overlapping async saves, loaded back equal"
    )
    return PASSED


def _plain_state(torch: Any, zeros: bool) -> "tuple[Any, Any, str]":
    """A tensor, and ``args`` in the common state as Megatron-LM keeps them (an
    ``argparse.Namespace``, which torch >= 2.6 refuses to load by default)."""
    import argparse

    from megatron.core.dist_checkpointing import ShardedTensor

    expected = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    args = argparse.Namespace(ckpt_format="torch_dist", use_distributed_optimizer=True, lr=1e-4)
    data = torch.zeros_like(expected) if zeros else expected.clone()
    state = {KEY: ShardedTensor.from_rank_offsets(KEY, data, replica_id=0), "args": None if zeros else args}
    return state, {KEY: expected, "args": args}, "one 64x64 float32 tensor and Namespace args"


def _optimizer_state(torch: Any, zeros: bool) -> "tuple[Any, Any, str]":
    """A weight and its optimizer state as megatron-core's distributed optimizer saves it
    (fully_sharded_model_space): the weight's ShardedTensor with a flattened_range."""
    import dataclasses

    from megatron.core.dist_checkpointing import ShardedTensor

    weight = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    state_key = "optimizer.state.exp_avg." + KEY
    model = ShardedTensor.from_rank_offsets(KEY, torch.zeros_like(weight) if zeros else weight.clone(), replica_id=0)
    flat = (weight * 0.5).flatten()
    optimizer = dataclasses.replace(
        model, key=state_key, data=torch.zeros_like(flat) if zeros else flat.clone(), flattened_range=slice(0, 48)
    )
    return {KEY: model, state_key: optimizer}, {KEY: weight, state_key: flat}, "an 8x6 weight and its flattened state"


def _round_trip(
    streams: _Streams, name: str, build: Any, torch: Any, dist_checkpointing: Any, info: Any, folder: Any
) -> int:
    state, expected, what = build(torch, zeros=False)
    with tempfile.TemporaryDirectory(prefix="mcore-autopatch-selftest-", dir=folder) as ckpt:
        streams.progress("%s state: async save of %s (gloo, 1 rank) to %s" % (name, what, ckpt))
        started = time.perf_counter()
        try:
            if "async_sharded_save" in inspect.signature(dist_checkpointing.save).parameters:
                dist_checkpointing.save(state, ckpt, ("torch_dist", 1), async_sharded_save=True).execute_sync()
            else:  # megatron-core 0.6: synchronous saves only
                dist_checkpointing.save(state, ckpt, ("torch_dist", 1))
        except Exception as exc:
            error = "%s: %s" % (type(exc).__name__, exc)
            if _needs_cuda(exc, torch):
                streams.verdict("cannot run: this megatron-core's save path needs CUDA (%s)" % error)
                return CANNOT_RUN
            streams.progress("the save failed after %.2f s" % (time.perf_counter() - started))
            hint = ""
            if "_write_item()" in str(exc):
                hint = "; this is the failure mcore-autopatch fixes: %s" % (info["advice"] or info["reason"])
            streams.verdict("FAILED: %s state: the save raised %s%s" % (name, error, hint))
            return FAILED
        lost = _lost_attributes(ckpt) if name != "plain" else []
        if lost:
            streams.verdict(
                "FAILED: %s state: saved, but the checkpoint lacks %s: a job with the distributed optimizer could not "
                "resume from it (%s)" % (name, " and ".join(lost), _metadata_fix_reason()),
            )
            return FAILED
        saved = time.perf_counter() - started
        template, _, _ = build(torch, zeros=True)
        try:
            loaded = dist_checkpointing.load(template, ckpt)
        except Exception as exc:
            streams.verdict("FAILED: %s state: the load raised %s: %s" % (name, type(exc).__name__, exc))
            return FAILED
        differing = sorted(k for k, v in expected.items() if not _equal(torch, loaded.get(k), v))
        if differing:
            streams.verdict(
                "FAILED: %s state: loaded values differ from the saved ones: %s" % (name, ", ".join(differing))
            )
            return FAILED
        streams.progress(
            "%s state: saved in %.2f s, loaded back equal in %.2f s"
            % (name, saved, time.perf_counter() - started - saved),
        )
    return PASSED


def _history_state(torch: Any, length: int, zeros: bool) -> "tuple[Any, Any]":
    """A tensor and an object whose pickled size grows from save to save (a loader's state)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    weight = torch.full((16, 16), float(length))
    history = list(range(length))
    state = {
        KEY: ShardedTensor.from_rank_offsets(KEY, torch.zeros_like(weight) if zeros else weight.clone(), replica_id=0),
        "history": ShardedObject("history", None if zeros else history, (1,), (0,), replica_id=0),
    }
    return state, {KEY: weight, "history": history}


def _overlapping_saves(streams: _Streams, torch: Any, dist_checkpointing: Any, folder: Any) -> int:
    """Two async saves in flight at once, the second's write done first, then finalized in
    call order, as Megatron-LM's loop finalizes them: each must load back its own state."""
    if "async_sharded_save" not in inspect.signature(dist_checkpointing.save).parameters:
        return PASSED  # megatron-core 0.6: synchronous saves only
    lengths = (100, 300)
    with tempfile.TemporaryDirectory(prefix="mcore-autopatch-selftest-", dir=folder) as root:
        folders = [os.path.join(root, "iter_%d" % i) for i in (1, 2)]
        streams.progress("overlapping async saves: two saves in flight, the second's write done first, in %s" % root)
        try:
            requests = []
            for ckpt, length in zip(folders, lengths):
                os.makedirs(ckpt)
                state, _ = _history_state(torch, length, zeros=False)
                requests.append(dist_checkpointing.save(state, ckpt, ("torch_dist", 1), async_sharded_save=True))
            for request in reversed(requests):  # the writes: the later save's ends first
                request._replace(finalize_fns=[]).execute_sync()
            for request in requests:  # the finalizes: in call order
                for finalize in request.finalize_fns:
                    finalize()
        except Exception as exc:
            streams.verdict("FAILED: overlapping async saves: a save raised %s: %s" % (type(exc).__name__, exc))
            return FAILED
        for i, (ckpt, length) in enumerate(zip(folders, lengths), start=1):
            template, expected = _history_state(torch, length, zeros=True)
            try:
                loaded = dist_checkpointing.load(template, ckpt)
            except BaseException as exc:  # torch's CheckpointException is a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                streams.verdict(
                    "FAILED: overlapping async saves: save %d reported success and cannot be loaded (%s): it was "
                    "finalized with the other save's write results" % (i, type(exc).__name__)
                )
                return FAILED
            if sorted(k for k, v in expected.items() if not _equal(torch, loaded.get(k), v)):
                streams.verdict("FAILED: overlapping async saves: save %d loaded the other save's values" % i)
                return FAILED
        streams.progress("overlapping async saves: each loaded back its own state")
    return PASSED


def _equal(torch: Any, loaded: Any, expected: Any) -> bool:
    if isinstance(expected, torch.Tensor):
        return isinstance(loaded, torch.Tensor) and torch.equal(loaded, expected)
    return bool(loaded == expected)


def _lost_attributes(ckpt: str) -> "list[str]":
    """What megatron-core sets on the checkpoint Metadata but is missing from the file."""
    from mcore_autopatch import fixes
    from mcore_autopatch.fixes import keep_mcore_data
    from mcore_autopatch.shared import checkpoint_metadata

    module = sys.modules.get(fixes.STRATEGIES_TORCH)
    metadata_type = getattr(sys.modules.get(keep_mcore_data.TORCH_METADATA_MODULE), "Metadata", None)
    if module is None:
        return []
    expected = keep_mcore_data.megatron_attributes(module, metadata_type)
    written = checkpoint_metadata.read_metadata(ckpt)
    # all_local_plans only lets a resumed job skip one re-planning; mcore_data decides a resume.
    return [name for name in expected if name != "all_local_plans" and not hasattr(written, name)]


def _metadata_fix_reason() -> str:
    from mcore_autopatch.cli import report

    rows = [r for r in report.status().get("fixes", []) if r["fix"] == "keep_mcore_data"]
    return rows[0]["reason"] if rows else "see mcore-autopatch status"
