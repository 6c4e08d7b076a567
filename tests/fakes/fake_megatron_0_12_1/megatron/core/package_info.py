"""FAKE megatron.core.package_info (tests/fakes)."""

__version__ = "0.12.1"
