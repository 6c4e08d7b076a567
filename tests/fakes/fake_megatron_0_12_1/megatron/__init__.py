"""FAKE ``megatron`` package (tests/fakes/fake_megatron_0_12_1): not megatron-core's code."""
