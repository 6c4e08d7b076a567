"""FAKE ``megatron.core.dist_checkpointing`` (tests/fakes): imports nothing."""
