"""FAKE ``torch.distributed.checkpoint`` (tests/fakes/fake_torch): an empty package."""
