"""Model architectures; ``registry`` maps config.json ``architectures`` to classes."""
