"""FAKE ``megatron.core.dist_checkpointing.strategies`` (tests/fakes): imports nothing."""
