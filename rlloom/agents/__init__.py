"""Agents trained through an OpenAI-compatible endpoint (`rollout.agent`, `rlloom serve`)."""
