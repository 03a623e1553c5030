"""Small models and callbacks the Lightning tests share (importable by ddp_spawn children)."""
