"""FAKE ``torch`` package for mcore-autopatch tests (tests/fakes/fake_torch): not torch.

For interpreters without torch. Only ``torch.distributed.checkpoint.filesystem`` has
content; ``FAKE_TORCH_GENERATION`` (2.6, 2.7, 2.8; default 2.8) picks its ``_write_item``.
"""

import os

__version__ = "%s.0+fake" % os.environ.get("FAKE_TORCH_GENERATION", "2.8")
FAKE = True
