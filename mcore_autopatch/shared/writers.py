"""The writers mcore-autopatch knows: modules that call torch's ``_write_item`` themselves.

Each entry says where the writer lives, where its version comes from, and from which
release it passes what torch asks for. The mechanism (watch the module, read torch's
signature and the writer's own call, rebind the module's ``_write_item`` global) is the same
for every entry. Adding a writer is one entry here, its row in the table of fixes
(``mcore_autopatch/fixes/__init__.py``), its module name in the startup watch list of
``mcore_autopatch/__init__.py`` (a test checks that the two agree), and its tests.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from mcore_autopatch.shared.values import Record


class KnownWriter(Record):
    """One writer: ``name`` is the distribution as users know it, used in every message;
    ``module`` the module whose ``_write_item`` global is rebound; ``distributions`` the
    metadata names its version is read from; ``package_info`` a module with ``__version__``,
    for source trees without metadata; from ``fixed_in`` it passes serialization_format
    itself, from ``passes_transforms_from`` the writer's transforms; ``async_module`` holds its
    async callers and their queue (``AsyncCallsQueue``). ``importers`` are the
    modules that import ``module`` at their top in every release: when one has executed, the
    writer is looked at again, in case a finder ahead of ours loaded it without us."""

    __slots__ = (
        "async_module",
        "distributions",
        "fixed_in",
        "importers",
        "module",
        "name",
        "package_info",
        "passes_transforms_from",
    )

    def __init__(
        self,
        name: str,
        module: str,
        distributions: Tuple[str, ...],
        package_info: Optional[str],
        fixed_in: Tuple[int, ...],
        passes_transforms_from: Tuple[int, ...],
        importers: Tuple[str, ...] = (),
        async_module: str = "",
    ) -> None:
        self.name = name
        self.module = module
        self.distributions = distributions
        self.package_info = package_info
        self.fixed_in = fixed_in
        self.passes_transforms_from = passes_transforms_from
        self.importers = importers
        self.async_module = async_module


MEGATRON_CORE = KnownWriter(
    name="megatron-core",
    module="megatron.core.dist_checkpointing.strategies.filesystem_async",
    distributions=("megatron-core", "megatron_core"),
    package_info="megatron.core.package_info",
    fixed_in=(0, 13),
    passes_transforms_from=(0, 12),
    importers=("megatron.core.dist_checkpointing.strategies.torch",),
    async_module="megatron.core.dist_checkpointing.strategies.async_utils",
)

# 0.3.0 carries megatron-core 0.12's call; 0.4.0 reads torch's signature. 0.1.x and 0.2.x
# have no such module, so there is nothing to watch for them.
NVIDIA_RESILIENCY_EXT = KnownWriter(
    name="nvidia-resiliency-ext",
    module="nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
    distributions=("nvidia-resiliency-ext", "nvidia_resiliency_ext"),
    package_info=None,
    fixed_in=(0, 4),
    passes_transforms_from=(0, 3),
    async_module="nvidia_resiliency_ext.checkpointing.async_ckpt.core",
)

KNOWN_WRITERS: Tuple[KnownWriter, ...] = (MEGATRON_CORE, NVIDIA_RESILIENCY_EXT)
BY_MODULE: Dict[str, KnownWriter] = {w.module: w for w in KNOWN_WRITERS}


def writers_imported_by(importer: str) -> Tuple[KnownWriter, ...]:
    return tuple(w for w in KNOWN_WRITERS if importer in w.importers)


def for_module(name: str) -> Optional[KnownWriter]:
    return BY_MODULE.get(name)
