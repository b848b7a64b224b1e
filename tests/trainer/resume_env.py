"""A multi-turn environment for the asynchronous stop tests (loaded from this folder, the runs'
reward.import_dir): an observation after each of the first two turns, then done with no reward
(the reward function scores the last answer, so the signalling reward still counts its calls)."""

from __future__ import annotations


class ThreeTurns:
    def step(self, messages, state):
        state["n"] = state.get("n", 0) + 1
        if state["n"] >= 3:
            return {"done": True, "reward": None}
        return {"observations": [{"role": "user", "content": f"try again ({state['n']})"}]}
