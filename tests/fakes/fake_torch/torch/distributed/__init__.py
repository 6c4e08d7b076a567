"""FAKE ``torch.distributed`` (tests/fakes/fake_torch): an empty package."""
