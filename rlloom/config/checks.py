"""The shared value checks of the config sections and the user-error types they raise.

Every check raises `ConfigError` naming the key, the value, the rule and the fix; the CLI prints
the one line and exits 2.
"""

from __future__ import annotations

import math
from dataclasses import fields

MAX_SEED = 2**32 - 1
"""Largest seed: `numpy.random.seed` accepts 0..2**32-1, the narrowest range of the RNGs a run seeds
(`random.seed` takes any int, `torch.manual_seed` -2**63..2**64-1)."""


class UserError(ValueError):
    """A mistake in what the user gave (config, data file, model path): the CLI prints its one-line
    message as `rlloom: error: ...` and exits 2, without a traceback. Internal bugs raise other types."""


class ConfigError(UserError):
    """A user error in the run configuration (unknown key, wrong type, impossible value)."""


def check(ok: bool, key: str, value: object, rule: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {rule}. Fix: {fix}.")


def check_finite(section: object, prefix: str) -> None:
    """Every float of a section (and of its tuples) must be finite: no field here accepts NaN or
    infinity, so `.inf` / `.nan` in YAML are refused before any range check can be fooled by them."""
    for f in fields(section):  # type: ignore[arg-type]
        value = getattr(section, f.name)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, float) and not math.isfinite(item):
                check(
                    False,
                    f"{prefix}.{f.name}",
                    value,
                    "must be a finite number (NaN and infinity are refused)",
                    f"give a finite number, e.g. the default {prefix}.{f.name}={f.default!r}",
                )


def check_seed(key: str, seed: int) -> None:
    check(
        0 <= seed <= MAX_SEED,
        key,
        seed,
        "must be in [0, 2**32-1] (numpy.random.seed's range, the narrowest of the seeded RNGs)",
        "use a seed such as 0 or 1234",
    )
