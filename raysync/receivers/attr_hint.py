"""The message for an ``@synced_model`` whose ``attr`` names no module on the actor: which ones do."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

import torch

from raysync.receivers.target import is_target

__all__ = ["missing_attr", "missing_module_message"]


def missing_module_message(owner: Any, attr: str) -> str:
    """Why ``owner.<attr>`` cannot be synced, naming the attributes that could, closest first.

    Example:
        >>> class Actor:
        ...     def __init__(self):
        ...         self.policy = torch.nn.Linear(2, 2)
        >>> missing_module_message(Actor(), "polcy")[:78]
        "@synced_model(attr='polcy'): self.polcy is missing; did you mean attr='policy'"
    """
    held = getattr(owner, attr, None)
    candidates = sorted(
        name
        for name, value in vars(owner).items()
        if not name.startswith("_raysync") and (isinstance(value, torch.nn.Module) or is_target(value))
    )
    close = difflib.get_close_matches(attr, candidates, n=1, cutoff=0.5)
    found = "is missing" if not hasattr(owner, attr) else f"holds a {type(held).__name__} object"
    hint = (
        f"; did you mean attr={close[0]!r}?"
        if close
        else f"; the actor's modules: {candidates}"
        if candidates
        else "; the actor holds no nn.Module attribute"
    )
    return (
        f"@synced_model(attr={attr!r}): self.{attr} {found}{hint} It must hold the nn.Module (or a "
        f"raysync Target such as a WeightsLoader) once __init__ returns; the first positional argument "
        "of @synced_model is that attribute's name (model_id= names the model)"
    )


def missing_attr(owner: Any, attrs: Iterable[str]) -> str | None:
    """The :func:`missing_module_message` of the first of ``attrs`` holding no module or target, or None.

    The actor's ``__init__`` raises it as a ``TypeError`` itself, before anything registers,
    so that the actor's creation error is this message after one frame of traceback.
    """
    for attr in attrs:
        held = getattr(owner, attr, None)
        if not isinstance(held, torch.nn.Module) and not is_target(held):
            return missing_module_message(owner, attr)
    return None
