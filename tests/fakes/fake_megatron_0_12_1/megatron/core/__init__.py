"""FAKE ``megatron.core`` (tests/fakes/fake_megatron_0_12_1): only what mcore-autopatch reads."""
