"""Model classes, the architecture registry and the checkpoint loader."""
