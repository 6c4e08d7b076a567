"""Record every call that reaches torch's real ``_write_item``, then run a job unchanged.

    SPY_WRITE_ITEM_LOG=calls.jsonl python spy_write_item.py examples/checkpoint_job.py [args]

Before anything imports megatron-core, torch's ``_write_item`` in
``torch.distributed.checkpoint.filesystem`` is replaced by a recorder that keeps torch's
signature (``functools.wraps``) and calls the real function. Each call appends one JSON
line: how many positional arguments it carried, the keyword names, and the type of the 6th
positional if there is one. Forked write workers append too. It never imports
mcore_autopatch: with the wheel installed, the calls it sees are the ones the fix makes.
"""

import functools
import json
import os
import runpy
import sys

import torch.distributed.checkpoint.filesystem as fs

LOG = os.environ["SPY_WRITE_ITEM_LOG"]
real = fs._write_item


@functools.wraps(real)
def recording_write_item(*args, **kwargs):
    row = {
        "positional": len(args),
        "keywords": sorted(kwargs),
        "sixth": type(args[5]).__name__ if len(args) > 5 else None,
        "pid": os.getpid(),
    }
    with open(LOG, "a") as f:
        f.write(json.dumps(row) + "\n")
    return real(*args, **kwargs)


fs._write_item = recording_write_item
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
