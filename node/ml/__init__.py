"""Models, data and checkpoints: what a role trains, on what, and how it is saved (safetensors only)."""
