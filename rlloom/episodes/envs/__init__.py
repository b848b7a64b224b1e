"""Built-in environments for `rollout.env` (e.g. "rlloom.episodes.envs.retry:AnswerRetry")."""
