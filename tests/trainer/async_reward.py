"""A test reward that often ties within a group (for dynamic sampling), in a module that imports
nothing (reward plug-ins run in worker processes, which import it)."""


def starts_with_digit(response_text: str, ground_truth: str) -> float:
    """1 when the response starts with a digit: about one response in ten of the tiny random model."""
    return float(response_text[:1].isdigit())
