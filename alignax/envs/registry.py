"""Environments by name: the built-ins, or a user's class named ``"package.module:Class"``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from alignax.config import ConfigError, load_callable
from alignax.envs.base import Environment
from alignax.envs.calculator import CalculatorEnv
from alignax.envs.feedback import RetryEnv

ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnv, "retry": RetryEnv}


def env_spec(env: Any) -> str:
    """The ``env.name`` that builds ``env``'s class: a built-in's name, else ``package.module:Class``."""
    cls = type(env)
    builtin = [name for name, known in ENVIRONMENTS.items() if known is cls]
    return builtin[0] if builtin else f"{cls.__module__}:{cls.__qualname__}"


def env_factory(name: str, kwargs: Mapping[str, Any] | None = None) -> Callable[[], Environment]:
    """A callable making a fresh environment per trajectory: ``ENVIRONMENTS[name](**kwargs)``
    or the class ``"package.module:Class"`` names. One instance is built here, so bad
    kwargs fail now as a :class:`ConfigError` naming ``env.kwargs``."""
    kwargs = dict(kwargs or {})
    if name in ENVIRONMENTS:
        cls = ENVIRONMENTS[name]
    elif ":" in name:
        cls = load_callable(name)
    else:
        raise ConfigError(f"env.name={name!r} is not a built-in environment ({', '.join(ENVIRONMENTS)}) "
                          "nor a 'package.module:Class' spec")
    try:
        env = cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"env.kwargs={kwargs!r} do not build env.name={name!r}: {err}") from err
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"env.name={name!r} builds a {type(env).__name__}, which lacks {' and '.join(missing)}; "
                          "an environment has reset(record) -> messages and step(message) -> (messages, reward, "
                          "done, info)")
    return functools.partial(cls, **kwargs)
