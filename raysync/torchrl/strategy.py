"""How weights are taken from and put into a model (torchrl's ``WeightStrategy``), and
model paths such as ``"env.transform[0]"`` resolved on a context.
"""

from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Mapping
from typing import Any, Literal

import torch

from raysync._protocol import ApplyReport
from raysync.channels.shared_mem import SharedMemTransport as _ChannelSharedMem
from raysync.core.codec import pack
from raysync.core.extract import (
    _is_tensordict,
    extract_extra_state,
    extract_tensors,
    to_tensordict,
)
from raysync.core.layout import _EXTRA, plan_layout
from raysync.errors import (
    UnknownModelError,
)
from raysync.receivers.pipeline import Applier
from raysync.receivers.target import ModuleTarget, Target, TensorsTarget, is_target

__all__ = ["ExtractAs", "SharedMemTransport", "WeightStrategy", "resolve_model", "split_extra_state"]


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
        """The weights of ``source`` (module, TensorDict or state dict) in this strategy's format.

        As torchrl does: in ``"tensordict"`` format a module's own extra state
        (``get_extra_state()``, e.g. running statistics kept outside its buffers)
        comes under the ``"__extra_state__"`` key; in ``"state_dict"`` format it
        comes as ``state_dict()`` puts it (``"..._extra_state"`` keys).
        """
        if self.extract_as == "state_dict":
            if isinstance(source, torch.nn.Module) and hasattr(source, "merge_and_unload"):
                # a PEFT model, as torchrl 0.14 gives it: merged, the live module untouched
                # (an adapter alone moves with raysync.lora_adapter, see docs/torchrl.md)
                merged: Any = copy.deepcopy(source)
                return dict(merged.merge_and_unload().state_dict())
            tensors: dict[str, Any] = dict(extract_tensors(source))
            tensors.update(extract_extra_state(source))
            return tensors
        if isinstance(source, torch.nn.Module) or not _is_tensordict(source):
            td = to_tensordict(extract_tensors(_without_extra(source)))
        else:
            return source
        extra = _own_extra_state(source)
        if extra:
            from tensordict import TensorDict

            td["__extra_state__"] = TensorDict(dict(extra), batch_size=[])
        return td

    def apply_weights(self, destination: Any, weights: Any, inplace: bool = True) -> None:
        """Apply ``weights`` to ``destination`` (module, TensorDict or state dict), whole or not at all.

        Extra state in ``weights`` (torchrl's ``"__extra_state__"`` entry, or a
        state dict's ``"..._extra_state"`` keys) goes to the module's
        ``set_extra_state`` in the same step; ``weights`` is never changed.
        ``inplace`` is accepted for torchrl's call shape: raysync always copies
        into the module's own memory (a weightless ``meta`` module gets memory).

        Raises:
            WeightMismatchError: keys, shapes or dtypes differ (nothing was changed).
        """
        if weights is None:
            return
        tensors, extra = split_extra_state(weights)
        apply_tensors(applier_for(destination), tensors, extra_state=extra)


def split_extra_state(
    weights: Any, *, non_persistent: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, extra_state)`` of weights: extra state as ``{state_dict key: object}``.

    Reads torchrl's ``"__extra_state__"`` entry (the top module's extra state),
    state dicts' ``"..._extra_state"`` keys and modules' ``get_extra_state()``.
    ``non_persistent``: a module's non-persistent buffers too (see ``extract_tensors``).

    Example:
        >>> tensors, extra = split_extra_state({"w": torch.ones(1), "__extra_state__": {"n": 1}})
        >>> list(tensors), extra
        (['w'], {'_extra_state': {'n': 1}})
    """
    extra: dict[str, Any] = {}
    if isinstance(weights, torch.nn.Module):
        return extract_tensors(weights, non_persistent=non_persistent), extract_extra_state(weights)
    if isinstance(weights, Mapping) and "__extra_state__" in weights.keys():
        own = weights["__extra_state__"]
        if _is_tensordict(own):
            own = own.clone().flatten_keys(".").to_dict()
        extra[_EXTRA] = dict(own) if isinstance(own, Mapping) else own
        weights = _without_extra(weights)
    if isinstance(weights, Mapping) and not _is_tensordict(weights):
        extra.update(extract_extra_state(weights))
    return extract_tensors(weights), extra


def _without_extra(weights: Any) -> Any:
    if not isinstance(weights, Mapping) or "__extra_state__" not in weights.keys():
        return weights
    if _is_tensordict(weights):
        return weights.exclude("__extra_state__")  # type: ignore[attr-defined]
    return {k: v for k, v in weights.items() if k != "__extra_state__"}


def _own_extra_state(source: Any) -> Any:
    """A module's own ``get_extra_state()`` (``None`` where it has none), as torchrl captures it."""
    if not isinstance(source, torch.nn.Module):
        return None
    try:
        return source.get_extra_state()
    except RuntimeError:  # torch's default: the module has no extra state
        return None


def _applier(destination: Any, *, non_persistent: bool = False) -> Applier:
    """The receiver pipeline of a torchrl destination, the same as every receiver's (an :class:`Applier`).

    A module gets a :class:`~raysync.receivers.target.ModuleTarget` (validate, then one copy per
    bucket into its cached binding); a :class:`~raysync.receivers.target.Target` (e.g. a
    :class:`~raysync.WeightsLoader`) is used as it is; a state dict or TensorDict gets a
    :class:`~raysync.receivers.target.TensorsTarget` (validate, then a copy into each tensor).
    ``non_persistent``: versions carry a module's non-persistent buffers too (the keys of
    ``TensorDict.from_module``).
    """
    target: Target
    if isinstance(destination, torch.nn.Module):
        target = ModuleTarget(destination, non_persistent=non_persistent, materialize=True)
    elif is_target(destination):
        target = destination
    else:
        target = TensorsTarget(destination)
    label = f"the torchrl receiver of a {type(destination).__name__}"
    return Applier(target, verify="if_present", timeout=None, label=label)


_APPLIERS: weakref.WeakKeyDictionary[Any, Applier] = weakref.WeakKeyDictionary()
_FULL_APPLIERS: weakref.WeakKeyDictionary[Any, Applier] = weakref.WeakKeyDictionary()


def applier_for(destination: Any, *, non_persistent: bool = False) -> Applier:
    """The pipeline of ``destination``: one per module (cached, so its binding is reused), else a new one."""
    if isinstance(destination, torch.nn.Module):
        cache = _FULL_APPLIERS if non_persistent else _APPLIERS
        applier = cache.get(destination)
        if applier is None:
            applier = cache[destination] = _applier(destination, non_persistent=non_persistent)
        return applier
    return _applier(destination, non_persistent=non_persistent)


def raise_failed(report: ApplyReport) -> None:
    """A refused or failed version raises its error (the destination keeps what it held)."""
    if report.failed is not None:
        assert report.error is not None
        raise report.error


def apply_tensors(
    applier: Applier, tensors: Mapping[str, torch.Tensor], *, extra_state: Mapping[str, Any] | None = None
) -> None:
    """Apply local tensors (and a module's extra state) through ``applier``, whole or not at all."""
    manifest = plan_layout(tensors)
    if extra_state and isinstance(applier.target, ModuleTarget):
        manifest = manifest.with_extra_state(extra_state)
    raise_failed(applier.take(manifest, pack(tensors, manifest)))


def _strategy(name: str) -> WeightStrategy:
    return WeightStrategy(extract_as=name)  # type: ignore[arg-type]


class SharedMemTransport(_ChannelSharedMem):  # type: ignore[misc]
    """:class:`raysync.channels.shared_mem.SharedMemTransport` with torchrl's default: a
    ``receive_weights(weights=, model=)`` without ``strategy=`` applies with :class:`WeightStrategy`.

    Example:
        >>> transport = SharedMemTransport()
        >>> transport.receive_weights(weights=shared, model=policy)   # whole or not at all
    """

    def default_strategy(self) -> Any:
        return WeightStrategy()
