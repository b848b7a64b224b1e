"""A dense test reward for the resume tests, in a module that imports nothing (reward plug-ins run in
worker processes, which import it): the tiny random model never answers right, so the task's reward
would be 0 everywhere and no update would change the policy."""


def digit_share(response_text: str, ground_truth: str) -> float:
    """The share of digits in the response."""
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)
