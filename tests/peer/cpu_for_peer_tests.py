"""Test-only pytest plugin: Megatron-LM's own unit tests of dist_checkpointing, run on CPU ranks.

Loaded with ``-p cpu_for_peer_tests`` by ``tools/peer_tests.py`` in each rank that
``torch.distributed.run`` starts. Megatron-LM's tests ask for NCCL and CUDA tensors; on a
machine without a GPU this plugin makes the process group gloo and redirects the CUDA calls
the checkpointing tests make to the CPU (``tests/job_path/cpu_stand_in_for_cuda.py`` and a few
more tensor factories), then records each test's outcome for this rank in
``$PEER_TESTS_OUT/rank<N>.json``. Nothing of megatron-core, and nothing the tests assert,
is changed; a test that needs what a CPU cannot give fails, and the runner says so.
"""

import json
import os
import sys
from typing import Any, Dict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "job_path"))
import cpu_stand_in_for_cuda

_results: Dict[str, Dict[str, str]] = {}


def _redirect_to_cpu() -> None:
    import torch
    import torch.distributed as dist

    if not cpu_stand_in_for_cuda.install():
        return  # a GPU machine: Megatron-LM's tests as they are
    for name in ("ones", "rand", "randn", "arange", "full", "randint", "zeros_like", "ones_like", "rand_like"):
        setattr(torch, name, cpu_stand_in_for_cuda._redirect_device(getattr(torch, name), "torch." + name))
    real_to = torch.Tensor.to

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple("cpu" if cpu_stand_in_for_cuda._is_cuda(a) else a for a in args)
        if cpu_stand_in_for_cuda._is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return real_to(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[method-assign]
    real_init = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        kwargs["backend"] = "gloo"
        args = args[1:] if args else args  # backend is the first positional parameter
        return real_init(*args, **kwargs)

    dist.init_process_group = init_process_group


def _without_transformer_engine() -> None:
    """Megatron-LM's conftest asks ``is_te_min_version("1.3")`` before every test; without
    Transformer Engine (a GPU package its CI image carries) that raises ModuleNotFoundError.
    Here it answers False, "not that version", as for a Transformer Engine that is too old."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core import utils

    real = utils.is_te_min_version

    def is_te_min_version(*args: Any, **kwargs: Any) -> bool:
        return False

    is_te_min_version.__wrapped__ = real  # type: ignore[attr-defined]
    utils.is_te_min_version = is_te_min_version


_redirect_to_cpu()
_without_transformer_engine()


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call" or report.outcome != "passed":
        entry = _results.setdefault(report.nodeid, {"outcome": "passed", "error": ""})
        if report.outcome != "passed" or report.when == "call":
            if entry["outcome"] == "passed":
                entry["outcome"] = report.outcome
            if report.outcome == "failed" and not entry["error"]:
                entry["error"] = _last_line(report)
            if report.outcome == "skipped" and not entry["error"]:
                entry["error"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""


def _last_line(report: Any) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return "%s (%s:%s)" % (crash.message.splitlines()[0][:400], os.path.basename(crash.path), crash.lineno)
    return str(report.longrepr).strip().splitlines()[-1][:400] if report.longrepr else ""


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    out = os.environ.get("PEER_TESTS_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "rank%s.json" % os.environ.get("RANK", "0")), "w") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
