"""A dense test reward for the resume tests, in a module that imports nothing (reward plug-ins run in
worker processes, which import it): the tiny random model never answers right, so the task's reward
would be 0 everywhere and no update would change the policy."""


def digit_share(response_text: str, ground_truth: str) -> float:
    """The share of digits in the response."""
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


_calls = 0


def _count_call_and_signal() -> None:
    """With RESUME_REWARD_SIGNAL=SIGNUM:CALL[:COUNT] set, send COUNT (default 1) signals SIGNUM to the
    trainer (this worker's parent) at the CALL-th call: a Ctrl-C or a scheduler's SIGTERM that lands
    in the middle of a step."""
    global _calls
    import os
    import time

    _calls += 1
    spec = os.environ.get("RESUME_REWARD_SIGNAL", "")
    if spec:
        signum, call, *count = (int(x) for x in spec.split(":"))
        if _calls == call:
            for i in range(count[0] if count else 1):
                time.sleep(0.5 * (i > 0))  # two at once would reach the trainer's handler as one
                os.kill(os.getppid(), signum)


def digit_share_signalling(response_text: str, ground_truth: str) -> float:
    """`digit_share`, signalling the trainer as RESUME_REWARD_SIGNAL says."""
    _count_call_and_signal()
    return digit_share(response_text, ground_truth)


def starts_with_digit_signalling(response_text: str, ground_truth: str) -> float:
    """1 when the response starts with a digit (ties in most groups: dynamic sampling draws extra
    rounds), signalling the trainer as RESUME_REWARD_SIGNAL says."""
    _count_call_and_signal()
    return float(response_text[:1].isdigit())
