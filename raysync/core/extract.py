"""Weights in: a module, a TensorDict or a state dict becomes ``{dotted_key: tensor}``.

Example:
    >>> list(extract_tensors({"a": {"b": torch.ones(1)}, "c.d": torch.zeros(2)}))
    ['a.b', 'c.d']
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from raysync.core.layout import _EXTRA, WeightsLike, _is_extra_key, schema_of
from raysync.errors import InvalidWeightsError

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = [
    "extract_extra_state",
    "extract_tensors",
    "extract_with_order",
    "module_schema",
    "non_persistent_buffers",
    "state_dict_tensordict",
    "to_tensordict",
]


def extract_with_order(
    weights: WeightsLike, *, non_persistent: bool = False
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Flatten weights into ``{dotted_key: tensor}``, sorted by key.

    A module's extra state (``get_extra_state()``, the ``"..._extra_state"``
    entries of its state dict; also such entries of a state dict) is left
    out: :func:`extract_extra_state` returns it.

    Args:
        weights: an ``nn.Module`` (its parameters and persistent buffers), a
            ``TensorDict``, or a nested or dotted state dict.
        non_persistent: a module's non-persistent buffers too
            (``register_buffer(..., persistent=False)``: not in its state dict),
            keyed as their parameters are; the keys ``TensorDict.from_module``
            has. Ignored for a TensorDict or a state dict (they hold what they hold).

    Returns:
        The tensors, detached, in canonical (sorted) key order (no copy,
        except that conjugate and negative views, ``x.conj()``,
        ``x.conj().imag``, are resolved to their values), and their keys in
        the weights' own order (a module's ``state_dict()`` order).

    Raises:
        InvalidWeightsError: the weights are empty, hold a non-tensor leaf, or
            a tensor whose bytes alone are not its value: sparse, nested,
            meta or quantized (the message names the key and the fix).

    Example:
        >>> tensors, order = extract_with_order({"c.d": torch.zeros(2), "a": {"b": torch.ones(1)}})
        >>> list(tensors), order
        (['a.b', 'c.d'], ['c.d', 'a.b'])
    """
    flat: dict[str, torch.Tensor] = {}
    module = isinstance(weights, torch.nn.Module)
    if module:
        flat = _module_tensors(weights, keep_vars=False, non_persistent=non_persistent)
    elif _is_tensordict(weights):
        flat = {str(key): value for key, value in weights.flatten_keys(".").items()}
    elif isinstance(weights, Mapping):
        _flatten_mapping(weights, "", flat, {})
    else:
        raise InvalidWeightsError(
            f"cannot take weights from an object of type {type(weights).__name__}: pass an nn.Module, "
            "a TensorDict or a (nested) state dict of tensors"
        )
    if not flat:
        raise InvalidWeightsError(
            "no tensors to push: the weights are empty (a module without parameters or "
            "buffers, or an empty dict)"
        )
    if module:  # state_dict() detached them (unless a hook of the module's did not): not twice, as
        # a DTensor's detach is a dispatch of its own (~10 us each)
        return {key: _packable(key, _detached(flat[key])) for key in sorted(flat)}, list(flat)
    return {key: _packable(key, flat[key].detach()) for key in sorted(flat)}, list(flat)


def extract_tensors(weights: WeightsLike, *, non_persistent: bool = False) -> dict[str, torch.Tensor]:
    """:func:`extract_with_order`'s tensors alone: see there.

    Example:
        >>> list(extract_tensors({"b": torch.ones(1), "a": torch.ones(1)}))
        ['a', 'b']
    """
    return extract_with_order(weights, non_persistent=non_persistent)[0]


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def _packable(key: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as plain strided memory whose bytes are its value, or a clear refusal."""
    if t.layout != torch.strided or t.is_nested:
        raise InvalidWeightsError(
            f"weight {key!r} is a {'nested' if t.is_nested else 'sparse'} tensor ({t.layout}): raysync "
            "moves dense tensors only; push t.to_dense() (or t.to_padded_tensor(0.0) for a nested one), "
            "or keep a dense copy in the module"
        )
    if t.is_meta:
        raise InvalidWeightsError(
            f"weight {key!r} is on the meta device and holds no data: materialise the model first "
            "(e.g. module.to_empty(device='cpu'), then initialise or load its weights), then push"
        )
    if t.is_quantized:
        raise InvalidWeightsError(
            f"weight {key!r} is quantized ({t.dtype}): its scale and zero point would be lost; push "
            "t.dequantize(), or push t.int_repr() with its scale and zero point as tensors of their own "
            "(t.q_scale(), t.q_zero_point(); per channel: t.q_per_channel_scales(), "
            "t.q_per_channel_zero_points())"
        )
    if t.is_conj() or t.is_neg():
        # A lazy view: its memory holds the un-conjugated / un-negated values.
        t = t.resolve_conj().resolve_neg()
    return t


def extract_extra_state(weights: WeightsLike) -> dict[str, Any]:
    """The extra state of a module's submodules, ``{state_dict key: get_extra_state()}``, sorted.

    For a module: every submodule whose class defines ``get_extra_state``.
    For a state dict: its ``"..._extra_state"`` entries. A ``TensorDict``
    has none. :meth:`Manifest.with_extra_state` packs the result into a
    version; receivers hand each object to the submodule's
    ``set_extra_state`` as part of applying that version.

    Example:
        >>> class Counter(torch.nn.Linear):
        ...     def get_extra_state(self):
        ...         return {"calls": 3}
        ...     def set_extra_state(self, state):
        ...         self.calls = state["calls"]
        >>> extract_extra_state(torch.nn.Sequential(Counter(2, 2)))
        {'0._extra_state': {'calls': 3}}
    """
    if isinstance(weights, torch.nn.Module):
        owners = _extra_state_owners(weights)
        return {key: owners[key].get_extra_state() for key in sorted(owners)}
    if isinstance(weights, Mapping) and not _is_tensordict(weights):
        extras: dict[str, Any] = {}
        _flatten_mapping(weights, "", {}, extras)
        return {key: extras[key] for key in sorted(extras)}
    return {}


def _extra_state_owners(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{"<prefix>._extra_state": submodule}`` for the submodules ``state_dict()`` asks for extra state."""
    base = torch.nn.Module.get_extra_state
    return {
        f"{name}.{_EXTRA}" if name else _EXTRA: sub
        for name, sub in module.named_modules(remove_duplicate=False)
        if getattr(type(sub), "get_extra_state", base) is not base  # as state_dict() decides
    }


def _module_tensors(
    module: torch.nn.Module, *, keep_vars: bool, non_persistent: bool = False
) -> dict[str, torch.Tensor]:
    """A module's state dict without its extra state entries (with ``non_persistent``: and
    its non-persistent buffers, under the keys ``state_dict()`` would give them)."""
    state = module.state_dict(keep_vars=keep_vars)
    if non_persistent:
        state.update(non_persistent_buffers(module, keep_vars=keep_vars))
    extra = _extra_state_owners(module) if any(_is_extra_key(k) for k in state) else {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in extra:
            continue
        if not isinstance(value, torch.Tensor):
            raise InvalidWeightsError(
                f"{type(module).__name__}.state_dict()[{key!r}] is of type {type(value).__name__}, not a "
                "tensor: only parameters, buffers and get_extra_state() can be pushed"
            )
        out[key] = value
    return out


def non_persistent_buffers(module: torch.nn.Module, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``{dotted_key: buffer}`` of the buffers a module's ``state_dict()`` leaves out.

    Those registered with ``register_buffer(name, t, persistent=False)``; a
    submodule reached by several paths appears under each, as in ``state_dict()``.
    Buffers set to ``None`` are skipped.

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> m.register_buffer("scale", torch.ones(1), persistent=False)
        >>> list(non_persistent_buffers(m))
        ['scale']
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name in sorted(sub._non_persistent_buffers_set):
            buf = sub._buffers.get(name)
            if buf is not None:
                out[f"{prefix}.{name}" if prefix else name] = buf if keep_vars else buf.detach()
    return out


def _is_tensordict(value: Any) -> bool:
    # Only an imported tensordict can have made a TensorDict: no need to import it to check.
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(value, module.TensorDictBase)


def _flatten_mapping(
    mapping: Mapping[Any, Any], prefix: str, out: dict[str, torch.Tensor], extras: dict[str, Any]
) -> None:
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise InvalidWeightsError(f"weight keys must be strings, got {key!r} ({type(key).__name__})")
        name = f"{prefix}{key}"
        if _is_extra_key(key):  # a module's get_extra_state(), as state_dict() stores it
            extras[name] = value
        elif isinstance(value, torch.Tensor):
            if name in out:
                raise InvalidWeightsError(f"key {name!r} appears twice (nested and dotted)")
            out[name] = value
        elif _is_tensordict(value):
            for sub, tensor in value.flatten_keys(".").items():
                out[f"{name}.{sub}"] = tensor
        elif isinstance(value, Mapping):
            _flatten_mapping(value, name + ".", out, extras)
        else:
            raise InvalidWeightsError(
                f"weight {name!r} is of type {type(value).__name__}, not a tensor: "
                "only tensors (or nested dicts of tensors) can be pushed"
            )


def to_tensordict(tensors: Mapping[str, torch.Tensor]) -> TensorDict:
    """A nested TensorDict from dotted keys (``"a.b"`` becomes ``td["a", "b"]``).

    Example:
        >>> to_tensordict({"a.b": torch.ones(1)})["a", "b"]
        tensor([1.])
    """
    from tensordict import TensorDict  # imported on use: it costs seconds at start-up

    td = TensorDict({}, batch_size=[])
    for key, value in tensors.items():
        td.set(tuple(key.split(".")), value)
    return td


def state_dict_tensordict(tensors: Mapping[str, torch.Tensor]) -> TensorDict:
    """A TensorDict keyed as a state dict (``"a.b"`` stays one key): ``load_state_dict`` takes it.

    Example:
        >>> list(state_dict_tensordict({"a.b": torch.ones(1)}).keys())
        ['a.b']
    """
    from tensordict import TensorDict  # imported on use: it costs seconds at start-up

    return TensorDict(dict(tensors), batch_size=[])


def module_schema(
    module: torch.nn.Module, *, non_persistent: bool = False
) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype)}`` of a module's state dict (parameters and persistent buffers).

    Extra state (``"..._extra_state"`` entries) is not part of it. With
    ``non_persistent``, the module's non-persistent buffers are (the keys
    ``extract_tensors(module, non_persistent=True)`` gives).

    Example:
        >>> module_schema(torch.nn.Linear(2, 1))
        {'weight': ((1, 2), 'float32'), 'bias': ((1,), 'float32')}
    """
    return schema_of(_module_tensors(module, keep_vars=True, non_persistent=non_persistent))
