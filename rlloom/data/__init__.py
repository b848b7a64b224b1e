"""Records between stages, datasets, templating, packing and micro-batching."""
