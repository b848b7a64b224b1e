"""How a reward function is called: its form, read from its signature, and the checks on what it returns.

Standard library only: reward worker processes import this module.

Two forms, told apart by the parameter names (`inspect.signature`):
- per sample (the default): `fn(response_text, ground_truth, **keywords) -> float`. The first two
  parameters get the response and the ground truth (text) by position, whatever they are named, so
  every `(response_text, ground_truth)` function works unchanged. Keyword arguments: `prompt` (the
  prompt as the dataset row holds it: a string or a list of chat messages) and every column of the
  row under its own name, the answer column included as the row holds it (`answer`, `solution`,
  `ground_truth`: a number stays a number), and for procedural tasks the task's details (`a`, `op`,
  `b`). A function receives those it names as parameters, or all of them if it has `**kwargs`;
- batched, as TRL's GRPOTrainer calls reward functions: a function with a parameter named
  `completions` (`f(completions, **kwargs)`, `f(prompts, completions, **kwargs)`), called once per
  chunk of samples with keyword arguments only, each a list with one entry per sample:
  `completions`, `prompts`, `ground_truths` (the answers as text) and every column of the rows
  under its own name (None where a row lacks it). As in TRL, a completion is the response text for a
  row whose prompt is text, and `[{"role": "assistant", "content": text}]` for a row whose prompt is
  a list of chat messages, so TRL's functions for standard and conversational datasets run
  unchanged. It returns one score per completion: a list, tuple or 1-D array (a mapping, a set or a
  list of another length makes every sample of the call invalid).
Columns named like the arguments above do not reach the function under that name.

A score is valid when it is a real number (bool, int, float, a numpy number or numpy bool) of
magnitude at most `MAX_ABS_SCORE`; anything else, or an exception (`sys.exit` included), makes the
sample invalid or an error.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlloom.rewards.weighted import WeightedReward

Outcome = Literal["ok", "error", "invalid"]
Result = tuple[Outcome, float | str]
"""(outcome, payload): the score for `ok`, the exception as text for `error`, the bad value's repr
for `invalid`."""

MAX_ABS_SCORE = 1e15
"""Largest score magnitude accepted (the bound `rlloom.config.reward.MAX_ABS_SCORE` puts on
`reward.default_score`; this module imports the standard library only). The trainer's group and
batch statistics square differences of scores in float32 (largest 3.4e38): -3e38, a float32,
overflowed the group std and crashed the step. Within 1e15, the squared differences of a million
scores sum to at most 4e36."""


@dataclass(frozen=True, slots=True)
class RewardInput:
    """Everything a reward function may be given about one sample.

    Example: `RewardInput("12 + 35 = 47", "47", prompt="What is 12 + 35?", columns={"level": 1})`.
    """

    response_text: str
    ground_truth: str
    prompt: str | list[dict[str, str]] = ""
    """The prompt as the dataset row holds it (text or chat messages); "" when unknown."""
    columns: dict[str, Any] = field(default_factory=dict)
    """Every column of the row (the prompt and answer columns included, as the row holds them), or a
    procedural task's details, by name."""
    conversation: str = ""
    """The prompt and the response as the policy saw them: the sample's token ids decoded with every
    token kept (the policy's chat template's rendering). What a reward model scores; "" when unknown."""

    def completion(self) -> str | list[dict[str, str]]:
        """The response as TRL passes it to batched functions: text for a text prompt, one assistant
        message for a chat prompt."""
        if isinstance(self.prompt, list):
            return [{"role": "assistant", "content": self.response_text}]
        return self.response_text


@dataclass(frozen=True, slots=True)
class CallForm:
    """How to call one reward function (see the module docstring)."""

    batched: bool
    keywords: frozenset[str] | None
    """Keyword arguments it accepts beyond the fixed ones; None when it takes `**kwargs` (all)."""


def call_form(fn: Callable[..., object]) -> CallForm:
    """The form of `fn`, from its signature; a callable without one is a plain per-sample function."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return CallForm(batched=False, keywords=frozenset())
    batched = any(p.name == "completions" for p in params)
    named = params if batched else params[2:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return CallForm(batched=batched, keywords=None)
    return CallForm(
        batched=batched, keywords=frozenset(p.name for p in named if p.kind is not p.VAR_POSITIONAL)
    )


_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def signature_problem(fn: Callable[..., object]) -> str | None:
    """Why `fn` cannot be called in its form (per sample: two positional arguments, then keywords;
    batched: keywords only), or None. Checked when the reward is resolved, so that a function every
    call of which would fail stops the run at start-up instead of scoring every sample an error."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    form = call_form(fn)
    try:
        if form.batched:  # every parameter a keyword: `completions` and the rest (columns are checked apart)
            signature.bind(**{p.name: None for p in signature.parameters.values() if p.kind in _KEYWORD})
        else:
            signature.bind("", "", **dict.fromkeys(form.keywords or ()))
    except TypeError as e:
        shape = "fn(completions=[...], ...)" if form.batched else "fn(response_text, ground_truth, ...)"
        return f"{getattr(fn, '__name__', fn)}{signature} cannot be called as {shape}: {e}"
    return None


def missing_arguments(fn: Callable[..., object], columns: set[str]) -> list[str]:
    """Parameters of `fn` with no default that no sample can fill: neither a dataset column in
    `columns` nor an argument of its form (see the module docstring). A weighted sum: its terms'."""
    if isinstance(fn, WeightedReward):
        return sorted({name for term, _ in fn.terms for name in missing_arguments(term, columns)})
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    form = call_form(fn)
    given = {"completions", "prompts", "ground_truths"} if form.batched else {"prompt"}
    named = params if form.batched else params[2:]
    return [
        p.name
        for p in named
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in columns | given
    ]


def is_batched(fn: Callable[..., object]) -> bool:
    """True when `fn` (or a term of a weighted sum) is batched: it is then scored a chunk at a time."""
    if isinstance(fn, WeightedReward):
        return any(is_batched(term) for term, _ in fn.terms)
    return call_form(fn).batched


def as_score(value: object) -> float | None:
    """A float of magnitude at most `MAX_ABS_SCORE` from a real number (bool, int, float, a numpy
    number or numpy bool), else None."""
    if not (isinstance(value, numbers.Real) or _is_numpy_bool(value)):
        return None
    try:
        score = float(value)  # type: ignore[arg-type]
    except (OverflowError, ValueError):  # an int too large for a float
        return None
    return score if math.isfinite(score) and abs(score) <= MAX_ABS_SCORE else None


def _is_numpy_bool(value: object) -> bool:
    """numpy.bool_ (what `array > 0.5` holds): not a `numbers.Real`, unlike numpy's other scalars.
    Read from its dtype, since this module imports no numpy."""
    dtype = getattr(value, "dtype", None)
    return getattr(dtype, "kind", None) == "b" and getattr(value, "shape", None) == ()


def score_items(fn: Callable[..., object], items: Sequence[RewardInput]) -> list[Result]:
    """One result per item, in order; never raises. A weighted sum scores term by term: an item
    fails when any of its terms fails (the first failure is reported)."""
    if isinstance(fn, WeightedReward):
        return _weighted(fn, items)
    form = call_form(fn)
    if form.batched:
        return _call_batched(fn, form, items)
    reserved = _positional(fn)
    return [_call_one(fn, form, reserved, item) for item in items]


def _call_one(
    fn: Callable[..., object], form: CallForm, reserved: frozenset[str], item: RewardInput
) -> Result:
    keywords = (
        _select(form.keywords, {**item.columns, "prompt": item.prompt}, reserved=reserved)
        if form.keywords is None or form.keywords
        else {}
    )
    try:
        value = fn(item.response_text, item.ground_truth, **keywords)
    except (Exception, SystemExit) as e:  # a reward function's bug must not stop the run; it is counted
        return "error", f"{type(e).__name__}: {e}"[:500]
    score = as_score(value)
    return ("ok", score) if score is not None else ("invalid", repr(value)[:200])


def _call_batched(fn: Callable[..., object], form: CallForm, items: Sequence[RewardInput]) -> list[Result]:
    names = {name for item in items for name in item.columns}
    lists = {name: [item.columns.get(name) for item in items] for name in sorted(names)}
    fixed = {
        "completions": [item.completion() for item in items],
        "prompts": [item.prompt for item in items],
        "ground_truths": [item.ground_truth for item in items],
    }
    keywords = _select(form.keywords, {**lists, **fixed}, reserved=frozenset())
    try:
        returned = fn(**keywords)
    except (Exception, SystemExit) as e:
        return [("error", f"{type(e).__name__}: {e}"[:500])] * len(items)
    values = _score_list(returned)
    if values is None or len(values) != len(items):
        what = f"{type(returned).__name__} {str(returned)[:100]}"
        return [("invalid", f"a batched reward returned {what} for {len(items)} completions")] * len(items)
    scores = [as_score(v) for v in values]
    return [("ok", s) if s is not None else ("invalid", repr(v)[:200]) for s, v in zip(scores, values)]


def _score_list(returned: object) -> list[object] | None:
    """The scores of a batched call in order: from a list, tuple or other sequence, or a 1-D array;
    None for anything else (a mapping's keys, a set's arbitrary order, a string's characters)."""
    if isinstance(returned, (Mapping, str, bytes)):
        return None
    if isinstance(returned, Sequence) or getattr(returned, "ndim", None) == 1:
        return list(returned)  # type: ignore[call-overload]
    return None


def _weighted(fn: WeightedReward, items: Sequence[RewardInput]) -> list[Result]:
    totals: list[Result] = [("ok", 0.0)] * len(items)
    for term, weight in fn.terms:
        for i, (kind, payload) in enumerate(score_items(term, items)):
            if totals[i][0] != "ok":
                continue
            totals[i] = (kind, payload) if kind != "ok" else ("ok", totals[i][1] + weight * payload)
    return [
        (kind, p) if kind != "ok" or as_score(p) is not None else ("invalid", repr(p)) for kind, p in totals
    ]


def _select(
    accepted: frozenset[str] | None, available: dict[str, Any], *, reserved: frozenset[str]
) -> dict[str, Any]:
    return {k: v for k, v in available.items() if k not in reserved and (accepted is None or k in accepted)}


def _positional(fn: Callable[..., object]) -> frozenset[str]:
    """Names of the first two parameters (they get the response and ground truth by position)."""
    try:
        return frozenset(list(inspect.signature(fn).parameters)[:2])
    except (TypeError, ValueError):
        return frozenset()
