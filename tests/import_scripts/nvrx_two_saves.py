"""nvidia-resiliency-ext's writer with two saves in flight, driven for real on the CPU.

    python nvrx_two_saves.py

Its full async save asks for CUDA; this drives the parts of two saves that decide whose
results a finalize takes, with nvidia-resiliency-ext's own code: each ``FileSystemWriterAsync``
takes its results queue from the module function ``prepare_write_data`` calls (looked up as
``prepare_write_data`` looks it up), the later save's results arrive first (put as its write
process puts them), and the first save's ``retrieve_write_results`` runs. Never imports
mcore_autopatch. Prints one JSON line: whose results the first save took.
"""

import json
import sys
import tempfile

WRITER = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"


def main() -> int:
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as module

    prepare = vars(module.FileSystemWriterAsync)["prepare_write_data"].__code__.co_names
    getter = next(name for name in ("get_write_results_queue", "_get_write_results_queue") if name in prepare)
    writers = []
    for _ in range(2):
        writer = module.FileSystemWriterAsync(tempfile.mkdtemp(prefix="nvrx-two-saves-"))
        writer.results_queue = vars(module)[getter]()  # what prepare_write_data assigns
        writer.write_buckets = [("__0_0.distcp", "__0_0.distcp", ([], []))]  # one bucket each
        writers.append(writer)
    first, second = writers
    second.results_queue.put({0: ["results of save 2"]})  # the later save's write ends first
    first.results_queue.put({0: ["results of save 1"]})
    taken = first.retrieve_write_results()
    print(
        json.dumps(
            {
                "getter": getter,
                "shared_queue": first.results_queue is second.results_queue,
                "first_took": taken,
                "queue_per_save": bool(getattr(vars(module)[getter], "__mcore_autopatch__", False)),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
