"""How weights are taken from and put into a model (torchrl's ``WeightStrategy``), and
model paths such as ``"env.transform[0]"`` resolved on a context.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from raysync.core import codec
from raysync.core.bound import BoundModel
from raysync.core.codec import pack
from raysync.core.extract import extract_tensors, module_schema, to_tensordict
from raysync.core.layout import Manifest, plan_layout, schema_of, validate
from raysync.errors import (
    UnknownModelError,
)

if TYPE_CHECKING:
    pass

__all__ = ["ExtractAs", "WeightStrategy", "resolve_model"]


ExtractAs = Literal["tensordict", "state_dict"]


_PART = re.compile(r"^([^\[\]]+)((?:\[[^\]]+\])*)$")


def resolve_model(context: Any, path: str) -> Any:
    """The object at ``path`` on ``context``: ``"policy"``, ``"env.value_net"``, ``"env.transform[0]"``.

    Subscripts may be integers or quoted strings (``"models['actor']"``).

    Raises:
        UnknownModelError: a part of the path does not exist (the message names it).

    Example:
        >>> class C: pass
        >>> c = C(); c.env = C(); c.env.transform = [torch.nn.Linear(2, 2)]
        >>> type(resolve_model(c, "env.transform[0]")).__name__
        'Linear'
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"a model path must be a non-empty string, got {path!r}")
    obj = context
    done: list[str] = []
    for part in path.split("."):
        match = _PART.match(part)
        if match is None:
            raise ValueError(f"cannot parse {part!r} in model path {path!r}")
        name, subscripts = match.groups()
        getter = getattr(obj, "get_model", None) if not done and name != "policy" else None
        try:
            obj = getattr(obj, name)
        except AttributeError:
            if callable(getter):
                try:
                    obj = getter(name)
                except Exception as err:
                    raise UnknownModelError(f"no model {path!r}: {err}") from err
            else:
                where = ".".join(done) or type(context).__name__
                raise UnknownModelError(
                    f"no model {path!r}: {where} has no attribute {name!r}; pass model= or a path "
                    "such as 'policy' or 'env.transform[0]'"
                ) from None
        done.append(name)
        for raw in re.findall(r"\[([^\]]+)\]", subscripts):
            key: Any = raw[1:-1] if raw[:1] in "'\"" else int(raw)
            try:
                obj = obj[key]
            except (KeyError, IndexError, TypeError) as err:
                raise UnknownModelError(f"no model {path!r}: {'.'.join(done)}[{raw}] fails ({err})") from err
    return obj


class WeightStrategy:
    """How weights are extracted on the sender and applied on a worker.

    Args:
        extract_as: ``"tensordict"`` (a nested ``TensorDict``) or
            ``"state_dict"`` (a flat ``{dotted_key: tensor}`` in sorted key order).

    Applying always validates first (keys, shapes, dtypes; every problem at
    once, :class:`raysync.WeightMismatchError`) and then copies: a version is
    applied whole or not at all.

    Example:
        >>> s = WeightStrategy(extract_as="state_dict")
        >>> list(s.extract_weights(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """

    def __init__(self, extract_as: ExtractAs = "tensordict") -> None:
        if extract_as not in ("tensordict", "state_dict"):
            raise ValueError(f"extract_as must be 'tensordict' or 'state_dict', got {extract_as!r}")
        self.extract_as = extract_as

    def __repr__(self) -> str:
        return f"WeightStrategy(extract_as={self.extract_as!r})"

    def extract_weights(self, source: Any) -> Any:
        """The weights of ``source`` (module, TensorDict or state dict) in this strategy's format."""
        tensors = extract_tensors(source)
        return to_tensordict(tensors) if self.extract_as == "tensordict" else tensors

    def apply_weights(self, destination: Any, weights: Any, inplace: bool = True) -> None:
        """Apply ``weights`` to ``destination`` (module, TensorDict or state dict), whole or not at all.

        Raises:
            WeightMismatchError: keys, shapes or dtypes differ (nothing was changed).
        """
        if weights is None:
            return
        _target_for(destination).apply(extract_tensors(weights))


class _Target:
    """A model to apply versions to: validate, then one copy per bucket (cached binding)."""

    def __init__(self, destination: Any) -> None:
        self.ref = destination
        self._bound: BoundModel | None = None

    @property
    def is_module(self) -> bool:
        return isinstance(self.ref, torch.nn.Module)

    def schema(self) -> dict[str, tuple[tuple[int, ...], str]]:
        if self.is_module:
            return module_schema(self.ref)
        return schema_of(extract_tensors(self.ref))

    def _binding(self, manifest: Manifest) -> BoundModel:
        if self._bound is None or self._bound.layout_hash != manifest.layout_hash:
            self._bound = BoundModel(self.ref, manifest)
        return self._bound

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> None:
        manifest = plan_layout(tensors)
        validate(manifest, self.schema())
        if self.is_module:
            self._binding(manifest).apply(pack(tensors, manifest))
            return
        dest = extract_tensors(self.ref)
        with torch.no_grad():
            for key, value in tensors.items():
                dest[key].copy_(value)

    def apply_packed(
        self, manifest: Manifest, buckets: Sequence[Sequence[np.ndarray]], ids: Sequence[str | None] | None
    ) -> None:
        validate(manifest, self.schema())
        if self.is_module:
            self._binding(manifest).apply(buckets, ids)
            return
        self.apply({k: v.clone() for k, v in codec.unpack(manifest, buckets).items()})

    def copy_from(self, manifest: Manifest, flat: list[torch.Tensor]) -> None:
        """Copy a version straight out of flat buckets (e.g. a shared snapshot): one copy per bucket."""
        validate(manifest, self.schema())
        if not self.is_module:
            self.apply(codec.views(manifest, flat))
            return
        self._binding(manifest).copy_from(flat)

    def adopt(self, manifest: Manifest, flat: list[torch.Tensor]) -> None:
        validate(manifest, self.schema())
        if not self.is_module:
            self.apply(codec.views(manifest, flat))
            return
        self._binding(manifest).adopt(flat)


_TARGETS: weakref.WeakKeyDictionary[Any, _Target] = weakref.WeakKeyDictionary()


def _target_for(destination: Any) -> _Target:
    if isinstance(destination, torch.nn.Module):
        target = _TARGETS.get(destination)
        if target is None:
            target = _TARGETS[destination] = _Target(destination)
        return target
    return _Target(destination)


def _strategy(name: str) -> WeightStrategy:
    return WeightStrategy(extract_as=name)  # type: ignore[arg-type]
