"""Test-only: the few torch.cuda calls megatron-core's checkpoint path makes, redirected to the CPU.

Installed by ``training_job.py`` in each rank (and, through it, in the processes the ranks
fork or spawn) only when ``CPU_STAND_IN_FOR_CUDA=1`` and torch has no CUDA device; on a
GPU machine nothing here runs and the job uses CUDA as Megatron-LM does (``make gpu-check``).

Where megatron-core 0.8-0.15 call CUDA on this path (0.12.1's line numbers):

* ``strategies/async_utils.py:148, :546``: ``torch.tensor(..., device=torch.cuda.current_device())``,
  the all-reduce that asks whether an async save is done -> ``current_device()`` answers "cpu";
* ``strategies/async_utils.py:195``, ``strategies/filesystem_async.py:198``,
  ``strategies/fully_parallel.py:269, :278``: ``torch.cuda.synchronize()`` -> does nothing;
* ``exchange_utils.py:100-112, :307, :317, :478``: ``init_data('cuda')``,
  ``torch.empty_like(..., device='cuda')``, ``torch.empty(..., device='cuda')``, ``.cuda()``
  in the load-time exchange of replicated tensors -> the CPU;
* ``strategies/state_dict_saver.py:204``: ``torch.tensor(..., device='cuda')`` when a resumed
  job checks that it may reuse the loaded metadata -> the CPU;
* ``strategies/async_utils.py:488`` (0.16): the persistent worker's
  ``torch.cuda.set_device(rank % torch.cuda.device_count())`` -> one device, and nothing to set.

Every redirect records the megatron-core file and line that asked for it (``SITES``); the
job reports them and the tests check that they are only these kinds of sites.
"""

import collections
import os
import sys
from typing import Any, Callable, Counter

SITES: "Counter[str]" = collections.Counter()
_installed = False


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if os.sep + "megatron" + os.sep in path:
            parts = path.split(os.sep)
            where = os.sep.join(parts[parts.index("megatron") + 1 :])
            return "%s:%d" % (where, frame.f_lineno)
        frame = frame.f_back  # type: ignore[assignment]
    return "outside megatron"


def _is_cuda(device: Any) -> bool:
    return device == "cuda" or str(device).startswith("cuda") or getattr(device, "type", None) == "cuda"


def _redirect_device(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            SITES["%s(device='cuda') at %s" % (name, _caller())] += 1
            kwargs["device"] = "cpu"
        return function(*args, **kwargs)

    return call


def install() -> bool:
    """Redirect the calls above when torch has no CUDA device; return whether it did."""
    global _installed
    import torch

    if _installed or torch.cuda.is_available():
        return _installed

    def current_device() -> Any:
        SITES["torch.cuda.current_device() at %s" % _caller()] += 1
        return torch.device("cpu")

    def synchronize(device: Any = None) -> None:
        SITES["torch.cuda.synchronize() at %s" % _caller()] += 1

    def tensor_cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        SITES["Tensor.cuda() at %s" % _caller()] += 1
        return self

    def device_count() -> int:
        SITES["torch.cuda.device_count() at %s" % _caller()] += 1
        return 1

    def set_device(device: Any) -> None:
        SITES["torch.cuda.set_device() at %s" % _caller()] += 1

    torch.cuda.current_device = current_device
    torch.cuda.synchronize = synchronize
    torch.cuda.device_count = device_count
    torch.cuda.set_device = set_device
    torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign]
    for name in ("empty", "empty_like", "tensor", "zeros"):
        setattr(torch, name, _redirect_device(getattr(torch, name), "torch." + name))
    _installed = True
    return True
