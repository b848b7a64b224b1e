"""Episodes: the one seam where a prompt becomes a trajectory of model turns and observations
(single turn, an environment's `reset`/`step`, or tool calls), with exact token bookkeeping."""
