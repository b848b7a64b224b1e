"""Engines: `train/` (forward, backward and optimizer step) and `rollout/` (generation)."""
