"""Built-in verifiable tasks (arithmetic, countdown, visual_compare, visual_colour) and the factory
for a run's prompts."""

from rlloom.tasks.build import DEFAULT_REWARDS, build_task_source, default_reward_name, task_prompts

__all__ = ["DEFAULT_REWARDS", "build_task_source", "default_reward_name", "task_prompts"]
