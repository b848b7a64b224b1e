"""rlloom: reinforcement-learning post-training of LLMs, from a 2-core CPU to many GPUs."""

__version__ = "0.1.0"
