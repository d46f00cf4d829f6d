"""Read-only tensors: weights shared between actors that in-place writes must not touch."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import BuiltinFunctionType, MethodDescriptorType
from typing import Any, NamedTuple

import numpy as np
import torch

from raysync import _compat
from raysync.errors import ReadOnlyWeightsError

__all__ = ["ReadOnlyTensor"]


# These end in "_" or write, but only metadata: never the shared bytes.
_ALLOWED_INPLACE = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream", "__set__"})


# Python's augmented assignments; other dunders that start with "__i" (__int__, __index__,
# __invert__, __iter__) only read.
_INPLACE_DUNDERS = frozenset(
    {
        "__iadd__",
        "__isub__",
        "__imul__",
        "__imatmul__",
        "__itruediv__",
        "__ifloordiv__",
        "__idiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__setitem__",
    }
)


class _WriteSpec(NamedTuple):
    """Which arguments a function writes into, worked out once per function."""

    tensors: tuple[int, ...]  # positional arguments written when they are a tensor
    lists: tuple[int, ...]  # positional arguments written when they are a list or tuple of tensors
    names: frozenset[str]  # keyword arguments written
    when: tuple[int, str, bool] | None = None  # only if this argument (position, name, default) is true
    fresh: bool = False  # its ATen schemas say it returns new memory: no need to look for aliases


_READS_ONLY = _WriteSpec((), (), frozenset({"out"}))


_MAX_SPECS = 4096  # functions seen; bounded in case some are made on the fly
_SPECS: dict[Any, _WriteSpec] = {}


class ReadOnlyTensor(torch.Tensor):
    """A tensor whose memory is shared and must not be written.

    In-place operations raise :class:`raysync.ReadOnlyWeightsError`: methods
    and functions ending in ``_`` (``add_``, ``copy_``), ``x[0] = 1``, ``+=``,
    ``out=``, the list forms optimizers use (``torch._foreach_add_``,
    ``torch._fused_adam_``: any read-only tensor in a written list), ATen ops
    called directly (``torch.ops.aten.fill_.Scalar``: their schema says which
    arguments they write), and batch norm's running statistics in training
    mode. ``.numpy()`` gives a non-writeable array, so writing through it
    raises numpy's ``ValueError``. Views and ``.data`` / ``.detach()`` stay
    read-only; every other result is an ordinary tensor.

    Each function's write check is worked out once and cached: an op that
    writes nothing (a forward pass) costs a dictionary look-up.

    Example:
        >>> t = torch.ones(2).as_subclass(ReadOnlyTensor)
        >>> t.add_(1)
        Traceback (most recent call last):
        ...
        raysync.errors.ReadOnlyWeightsError: 'add_' would write into weights shared ...
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        try:
            spec = _SPECS.get(func)
        except TypeError:  # an unhashable callable: work it out every time
            spec = _write_spec(func)
        if spec is None:
            spec = _write_spec(func)
            if len(_SPECS) >= _MAX_SPECS:
                _SPECS.clear()
            _SPECS[func] = spec
        if (spec.tensors or spec.lists or kwargs) and _writes(spec, args, kwargs):
            name = getattr(func, "__name__", None) or repr(func)
            raise ReadOnlyWeightsError(
                f"{name!r} would write into weights shared read-only between actors "
                "(apply='view'); clone() them first, or use @synced_model(..., apply='copy') "
                "for weights this actor changes"
            )
        with _compat.plain_tensors():
            result = func(*args, **(kwargs or {}))
            return result if spec.fresh else _keep_read_only(result, args)


def _write_spec(func: Any) -> _WriteSpec:
    """Which arguments ``func`` writes: from its name, its ATen schemas, and a few special cases."""
    conditional = _conditional_writes().get(func)
    if conditional is not None:
        return conditional
    name = str(getattr(func, "__name__", "") or "")
    base = name.partition(".")[0]  # an OpOverload is named like "add_.Tensor"
    if base in _ALLOWED_INPLACE:
        return _READS_ONLY
    tensors: set[int] = set()
    lists: set[int] = set()
    names = {"out"}
    if base in _INPLACE_DUNDERS or (base.endswith("_") and not base.endswith("__")):
        tensors.add(0)  # in-place: self, or the list of tensors (torch._foreach_add_)
        lists.add(0)
    schemas = _schemas(func, base)
    for schema in schemas:
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            kind = str(arg.type)  # "Tensor(a!)" or "Tensor(a!)[]"; not "int[](a!)" (sort.int)
            if kind in ("Tensor", "Optional[Tensor]"):
                names.add(arg.name)
                if not arg.kwarg_only:
                    tensors.add(i)
            elif kind in ("List[Tensor]", "List[Optional[Tensor]]"):
                names.add(arg.name)
                if not arg.kwarg_only:
                    lists.add(i)
    # Public ATen ops annotate every result that aliases an input ("-> Tensor(a)"); private
    # ones (_unsafe_view) may not, so their results are always checked.
    fresh = (
        bool(schemas)
        and not base.startswith("_")
        and not any(r.alias_info is not None for schema in schemas for r in schema.returns)
    )
    return _WriteSpec(tuple(sorted(tensors)), tuple(sorted(lists)), frozenset(names), fresh=fresh)


def _schemas(func: Any, base: str) -> list[Any]:
    """The ATen schemas ``func`` may run: its own (an OpOverload), its overloads', or its namesake's."""
    try:
        schema = getattr(func, "_schema", None)
        if schema is not None:  # torch.ops.aten.add_.Tensor
            return [schema]
        if isinstance(func, _compat.OP_OVERLOAD_PACKET):  # torch.ops.aten.add_
            return [getattr(func, o)._schema for o in func.overloads()]
        if base and isinstance(func, (BuiltinFunctionType, MethodDescriptorType)):
            # torch.add_, Tensor.add_, torch._fused_adam_: bindings generated from ATen, same arguments.
            packet = getattr(torch.ops.aten, base, None)
            if isinstance(packet, _compat.OP_OVERLOAD_PACKET):
                return [getattr(packet, o)._schema for o in packet.overloads()]
    except (AttributeError, RuntimeError):  # no such op, or a schema torch cannot parse
        pass
    return []


@functools.cache
def _conditional_writes() -> dict[Any, _WriteSpec]:
    """Ops that write only in some modes: batch and instance norm update running statistics."""
    stats = frozenset({"running_mean", "running_var"})
    F = torch.nn.functional
    return {
        F.batch_norm: _WriteSpec((1, 2), (), stats, (5, "training", False)),
        F.instance_norm: _WriteSpec((1, 2), (), stats, (5, "use_input_stats", True)),
        torch.batch_norm: _WriteSpec((3, 4), (), stats, (5, "training", False)),
        torch.instance_norm: _WriteSpec((3, 4), (), stats, (5, "use_input_stats", False)),
    }


def _writes(spec: _WriteSpec, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bool:
    if spec.when is not None:
        pos, key, default = spec.when
        flag = args[pos] if len(args) > pos else (kwargs or {}).get(key, default)
        if not flag:
            return False
    for i in spec.tensors:
        if i < len(args) and isinstance(args[i], ReadOnlyTensor):
            return True
    for i in spec.lists:
        if i < len(args) and isinstance(args[i], (list, tuple)) and _holds_read_only(args[i]):
            return True
    if kwargs:
        for key in spec.names:
            value = kwargs.get(key)
            if value is not None and _holds_read_only(value):
                return True
    return False


def _holds_read_only(value: Any) -> bool:
    if isinstance(value, ReadOnlyTensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, ReadOnlyTensor) for v in value)


def _keep_read_only(result: Any, args: Sequence[Any]) -> Any:
    """Re-wrap results that share a read-only argument's memory. Runs with torch functions off."""
    if isinstance(result, torch.Tensor):
        if not isinstance(result, ReadOnlyTensor) and _in_read_only(result, args):
            return result.as_subclass(ReadOnlyTensor)
    elif isinstance(result, (tuple, list)):
        return type(result)(_keep_read_only(r, args) for r in result)
    elif isinstance(result, np.ndarray) and result.flags.writeable and _in_read_only(result, args):
        result.flags.writeable = False  # .numpy(), np.asarray(): writes raise ValueError
    return result


def _in_read_only(result: torch.Tensor | np.ndarray, args: Sequence[Any]) -> bool:
    """Whether ``result``'s memory lies in the storage of a read-only tensor among ``args``."""
    try:
        if isinstance(result, np.ndarray):
            if result.size == 0:
                return False
            ptr = result.ctypes.data
        else:
            if result.device.type == "meta":
                return False
            ptr = result.untyped_storage().data_ptr()
        for a in args:
            if isinstance(a, ReadOnlyTensor) and a.device.type != "meta":
                storage = a.untyped_storage()
                start = storage.data_ptr()
                if start <= ptr < start + max(storage.nbytes(), 1):
                    return True
    except (RuntimeError, NotImplementedError):  # storage-less tensors (sparse, functional wrappers)
        return False
    return False


# What torch's autograd says when nothing on the way back requires grad: a loss computed only
# from read-only views (their requires_grad is False), by backward() and by torch.autograd.grad.
_NO_GRAD_MESSAGES = ("does not require grad and does not have a grad_fn", "Tensors does not require grad")


def view_training_error(err: RuntimeError, attrs: Sequence[str]) -> ReadOnlyWeightsError | None:
    """The clear error for torch's ``err`` when a method trained weights that are read-only views.

    ``attrs`` are the actor's ``apply="view"`` modules. A backward pass through them alone
    fails in torch before any optimizer step, with a message that names no cause; this gives
    the cause and the fix. ``None`` when ``err`` is something else (or no module is a view).
    """
    if not attrs or isinstance(err, ReadOnlyWeightsError):
        return None
    if not any(text in str(err) for text in _NO_GRAD_MESSAGES):
        return None
    names = ", ".join(f"self.{attr}" for attr in attrs)
    return ReadOnlyWeightsError(
        f"training failed: {names} holds weights shared read-only between actors (apply='view'), "
        "which take no gradients, so backward() found nothing to differentiate and no optimizer "
        "step can write them; use @synced_model(..., apply='copy') for a model this actor "
        f"trains, or train a copy of its own (torch's error: {err})"
    )
