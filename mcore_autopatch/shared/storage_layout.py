"""Where each item of a torch_dist checkpoint lies in its files, checked against the files.

Each ``.distcp`` file is written by one write worker, item after item: an item's ``offset`` is
the stream's position before it and its ``length`` what was written, so the items of a file
end exactly where the file ends. The write results of two saves of one job name the same
files and keys and differ only in offsets and lengths (the pickled objects, such as the rng
state, change size from save to save), so a checkpoint finalized with another save's results
shows here: a file longer or shorter than where its last item ends. One ``stat`` per file.

Used before ``.metadata`` is written (``fixes/results_match_files.py``) and by
``mcore-autopatch inspect`` on checkpoints already on disk.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Tuple

from mcore_autopatch.shared.values import Record


class FileMismatch(Record):
    """A file whose size is not where its last item ends: ``size`` on disk, ``end`` by the
    items (``offset + length`` of the last), ``items`` how many items it holds."""

    __slots__ = ("end", "items", "name", "size")

    def __init__(self, name: str, size: int, end: int, items: int) -> None:
        self.name = name
        self.size = size
        self.end = end
        self.items = items

    @property
    def text(self) -> str:
        if self.end > self.size:
            gap = "%d bytes past the end" % (self.end - self.size)
        else:
            gap = "%d bytes that no item covers" % (self.size - self.end)
        return "%s holds %d bytes, but its last item ends at %d (%s)" % (self.name, self.size, self.end, gap)


def ends_by_file(storage_infos: Iterable[Any]) -> Dict[str, Tuple[int, int]]:
    """``{relative path: (where its last item ends, how many items)}`` from torch's
    ``_StorageInfo`` values (``relative_path``, ``offset``, ``length``)."""
    ends: Dict[str, Tuple[int, int]] = {}
    for info in storage_infos:
        name = str(info.relative_path)
        end, count = ends.get(name, (0, 0))
        ends[name] = (max(end, int(info.offset) + int(info.length)), count + 1)
    return ends


def compare_with_files(folder: str, ends: Dict[str, Tuple[int, int]]) -> "Tuple[List[FileMismatch], List[str]]":
    """(mismatches, files that cannot be seen from here) for the items ``ends`` describes."""
    mismatches: List[FileMismatch] = []
    unseen: List[str] = []
    for name in sorted(ends):
        end, count = ends[name]
        try:
            size = os.stat(os.path.join(folder, name)).st_size
        except OSError:
            unseen.append(name)  # another node's local disk, or not there
            continue
        if size != end:
            mismatches.append(FileMismatch(name, size, end, count))
    return mismatches, unseen
