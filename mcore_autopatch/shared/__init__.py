"""What several fixes share: reading code and versions, the writers known, stand-in modules,
reading a checkpoint's ``.metadata``, small value classes and the logger."""
