"""Weights as data: extract, lay out in buckets, describe, validate, apply.

A version of a model travels as a few *buckets*. Each bucket is one Ray object
holding a list of uint8 numpy views of the trainer's tensors: ``ray.put`` of
such a list is a single copy, straight into the object store, and Ray lays the
buffers out back to back (64-byte aligned from 2 KiB up, 8-byte aligned
below). :func:`plan_layout` computes the same offsets, so a receiver can treat a
bucket as one flat buffer and apply it with one ``copy_``; it checks the real
addresses first and falls back to one copy per tensor if they differ.

A :class:`Manifest` says what is in the buckets (key, shape, dtype, bucket,
offset, bytes) and carries a ``layout_hash`` that changes only when the
structure of the model does. Everything here is bit-exact for every dtype:
bytes move as uint8 and are re-interpreted on arrival.

Example:
    >>> model = torch.nn.Linear(4, 2)
    >>> tensors = extract_tensors(model)
    >>> manifest = plan_layout(tensors)
    >>> buckets = pack(tensors, manifest)          # lists of uint8 views, no copy
    >>> views = unpack(manifest, buckets)          # back to tensors, no copy
    >>> torch.equal(views["weight"], model.weight)
    True
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import hashlib
import logging
import pickle
import sys
import warnings
import zlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import BuiltinFunctionType, MethodDescriptorType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from raysync.errors import (
    ChecksumError,
    InvalidWeightsError,
    ReadOnlyWeightsError,
    WeightMismatchError,
)

if TYPE_CHECKING:
    from tensordict import TensorDict

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "EXTRA_STATE_MAX_BYTES",
    "BoundModel",
    "Manifest",
    "ReadOnlyTensor",
    "TensorEntry",
    "bucket_checksums",
    "cast_floating",
    "extract_extra_state",
    "extract_tensors",
    "pack",
    "plan_layout",
    "require_checksums",
    "same_bytes",
    "schema_of",
    "to_tensordict",
    "unpack",
    "validate",
    "verify_checksums",
]

DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Default bucket size: big enough that a version is a handful of copies."""

EXTRA_STATE_MAX_BYTES = 2**20
"""The most pickled extra state (``get_extra_state()``) one version may carry."""

_EXTRA = "_extra_state"  # where state_dict() puts a module's get_extra_state() (torch's suffix)

# Ray's serializer aligns out-of-band buffers like this (see ray/includes/serialization.pxi).
_MAJOR_ALIGN = 64
_MINOR_ALIGN = 8
_MAJOR_SIZE = 2048

WeightsLike = Any  # nn.Module | TensorDictBase | Mapping[str, Tensor | Mapping]


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a version.

    Attributes:
        key: dotted name, as in ``state_dict()``.
        shape: the tensor's shape.
        dtype: the dtype's name without ``torch.`` (``"bfloat16"``).
        bucket: index of the bucket that holds it.
        index: position of its buffer in the bucket's list.
        offset: byte offset from the start of the bucket.
        nbytes: its size in bytes.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    index: int
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """The entry's dtype as a ``torch.dtype``."""
        return _dtype_from_name(self.dtype)


@dataclass(frozen=True)
class Manifest:
    """The description of one version's buckets; small, picklable, torch-free.

    Attributes:
        entries: one :class:`TensorEntry` per tensor, sorted by key.
        bucket_nbytes: the span of each bucket in bytes (padding included).
        layout_hash: changes exactly when keys, shapes, dtypes or the bucket
            plan change.
        checksums: one CRC32 per bucket when the pusher asked for them.
        transport: how the bucket bytes travel: ``"object_store"`` (each
            bucket a list of uint8 arrays in Ray's object store) or ``"nixl"``
            (each bucket one flat uint8 tensor sent by Ray's NIXL transport).
        extra_state: ``(key, pickled object)`` per submodule with extra state
            (``get_extra_state()``; the key is its ``state_dict()`` key, such
            as ``"norm._extra_state"``), sorted by key. Not part of
            ``layout_hash``: it may change from version to version.

    Example:
        >>> m = plan_layout({"w": torch.zeros(2, 3)})
        >>> m.entries[0].shape, m.total_nbytes
        ((2, 3), 24)
    """

    entries: tuple[TensorEntry, ...]
    bucket_nbytes: tuple[int, ...]
    layout_hash: str
    checksums: tuple[int, ...] | None = None
    transport: str = "object_store"
    extra_state: tuple[tuple[str, bytes], ...] = ()

    @property
    def num_buckets(self) -> int:
        """How many buckets (Ray objects) a version has."""
        return len(self.bucket_nbytes)

    @property
    def total_nbytes(self) -> int:
        """Bytes of tensor data in a version (padding excluded)."""
        return sum(e.nbytes for e in self.entries)

    def keys(self) -> list[str]:
        """The tensor keys, sorted."""
        return [e.key for e in self.entries]

    def schema(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype_name)}``, the part :func:`validate` compares."""
        return {e.key: (e.shape, e.dtype) for e in self.entries}

    def bucket_entries(self, bucket: int) -> list[TensorEntry]:
        """The entries of one bucket in buffer order."""
        return sorted((e for e in self.entries if e.bucket == bucket), key=lambda e: e.index)

    def with_checksums(self, checksums: Sequence[int] | None) -> Manifest:
        """A copy of this manifest carrying per-bucket checksums (or none)."""
        return dataclasses.replace(self, checksums=tuple(checksums) if checksums is not None else None)

    def with_transport(self, transport: str) -> Manifest:
        """A copy of this manifest for another transport (same layout)."""
        return dataclasses.replace(self, transport=transport)

    def with_extra_state(self, states: Mapping[str, Any]) -> Manifest:
        """A copy of this manifest carrying modules' extra state (see :func:`extract_extra_state`).

        Each object is pickled here, so a version carries the state as it was
        at push time.

        Raises:
            InvalidWeightsError: an object cannot be pickled, or all of them
                take more than :data:`EXTRA_STATE_MAX_BYTES`.

        Example:
            >>> m = plan_layout({"w": torch.zeros(2)}).with_extra_state({"_extra_state": {"steps": 3}})
            >>> m.extra_states()
            {'_extra_state': {'steps': 3}}
        """
        if not states and not self.extra_state:
            return self
        pickled = []
        for key in sorted(states):
            try:
                pickled.append((key, pickle.dumps(states[key], protocol=pickle.HIGHEST_PROTOCOL)))
            except Exception as err:
                raise InvalidWeightsError(
                    f"the extra state of {key!r} (get_extra_state()) cannot be pickled: {err}; return "
                    "plain Python objects and tensors from get_extra_state()"
                ) from err
        total = sum(len(b) for _, b in pickled)
        if total > EXTRA_STATE_MAX_BYTES:
            raise InvalidWeightsError(
                f"the extra state of this version (get_extra_state() of {[k for k, _ in pickled][:5]}) "
                f"takes {total} bytes pickled, more than {EXTRA_STATE_MAX_BYTES}: it travels with every "
                "notification; register large state as buffers instead"
            )
        return dataclasses.replace(self, extra_state=tuple(pickled))

    def extra_states(self) -> dict[str, Any]:
        """The extra state objects this version carries, ``{state_dict key: object}`` (unpickled)."""
        return {key: pickle.loads(data) for key, data in self.extra_state}


# --------------------------------------------------------------------------- extract


def extract_tensors(weights: WeightsLike) -> dict[str, torch.Tensor]:
    """Flatten weights into ``{dotted_key: tensor}``, sorted by key.

    A module's extra state (``get_extra_state()``, the ``"..._extra_state"``
    entries of its state dict; also such entries of a state dict) is left
    out: :func:`extract_extra_state` returns it.

    Args:
        weights: an ``nn.Module`` (its parameters and persistent buffers), a
            ``TensorDict``, or a nested or dotted state dict.

    Returns:
        The tensors, detached, in canonical (sorted) key order. No copy,
        except that conjugate and negative views (``x.conj()``,
        ``x.conj().imag``) are resolved to their values.

    Raises:
        InvalidWeightsError: the weights are empty, hold a non-tensor leaf, or
            a tensor whose bytes alone are not its value: sparse, nested,
            meta or quantized (the message names the key and the fix).

    Example:
        >>> list(extract_tensors({"a": {"b": torch.ones(1)}, "c.d": torch.zeros(2)}))
        ['a.b', 'c.d']
    """
    flat: dict[str, torch.Tensor] = {}
    if isinstance(weights, torch.nn.Module):
        flat = _module_tensors(weights, keep_vars=False)
    elif _is_tensordict(weights):
        for key, value in weights.flatten_keys(".").items():
            flat[str(key)] = value
    elif isinstance(weights, Mapping):
        _flatten_mapping(weights, "", flat, {})
    else:
        raise InvalidWeightsError(
            f"cannot take weights from a {type(weights).__name__}: pass an nn.Module, "
            "a TensorDict or a (nested) state dict of tensors"
        )
    if not flat:
        raise InvalidWeightsError(
            "no tensors to push: the weights are empty (a module without parameters or "
            "buffers, or an empty dict)"
        )
    return {key: _packable(key, flat[key].detach()) for key in sorted(flat)}


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


def _is_extra_key(key: str) -> bool:
    return key.rpartition(".")[2] == _EXTRA


def _extra_state_owners(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{"<prefix>._extra_state": submodule}`` for the submodules ``state_dict()`` asks for extra state."""
    base = torch.nn.Module.get_extra_state
    return {
        f"{name}.{_EXTRA}" if name else _EXTRA: sub
        for name, sub in module.named_modules(remove_duplicate=False)
        if getattr(type(sub), "get_extra_state", base) is not base  # as state_dict() decides
    }


def _module_tensors(module: torch.nn.Module, *, keep_vars: bool) -> dict[str, torch.Tensor]:
    """A module's state dict without its extra state entries."""
    state = module.state_dict(keep_vars=keep_vars)
    extra = _extra_state_owners(module) if any(_is_extra_key(k) for k in state) else {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in extra:
            continue
        if not isinstance(value, torch.Tensor):
            raise InvalidWeightsError(
                f"{type(module).__name__}.state_dict()[{key!r}] is a {type(value).__name__}, not a "
                "tensor: only parameters, buffers and get_extra_state() can be pushed"
            )
        out[key] = value
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
                f"weight {name!r} is a {type(value).__name__}, not a tensor: "
                "only tensors (or nested dicts of tensors) can be pushed"
            )


def schema_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype_name)}`` of a flat tensor dict, comparable with ``Manifest.schema()``.

    Example:
        >>> schema_of({"w": torch.zeros(2, dtype=torch.bfloat16)})
        {'w': ((2,), 'bfloat16')}
    """
    return {k: (tuple(t.shape), _dtype_name(t.dtype)) for k, t in tensors.items()}


# --------------------------------------------------------------------------- layout


def plan_layout(
    tensors: Mapping[str, torch.Tensor],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    separate: Collection[str] = (),
) -> Manifest:
    """Assign every tensor a bucket and an offset.

    Tensors fill buckets in key order; a bucket closes when the next tensor
    would take it past ``bucket_bytes`` (a larger tensor gets a bucket of its
    own). Inside a bucket, tensors of 2 KiB or more come first so that Ray's
    alignment of the buffers is predictable.

    Args:
        tensors: flat ``{key: tensor}`` (see :func:`extract_tensors`).
        bucket_bytes: the target bucket size.
        separate: keys that get buckets of their own, after the others (so a
            partial push of just those keys re-sends only their buckets).

    Returns:
        The manifest (without checksums).

    Example:
        >>> m = plan_layout({"a": torch.zeros(1000), "b": torch.zeros(1000)}, bucket_bytes=4000)
        >>> m.num_buckets
        2
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    apart = set(separate)
    groups: list[list[tuple[str, torch.Tensor]]] = []
    for selection in ([k for k in sorted(tensors) if k not in apart], sorted(apart & set(tensors))):
        filled = 0
        start = len(groups)
        for key in selection:
            t = tensors[key]
            nbytes = t.numel() * t.element_size()
            if len(groups) == start or (groups[-1] and filled + nbytes > bucket_bytes):
                groups.append([])
                filled = 0
            groups[-1].append((key, t))
            filled += nbytes
    entries: list[TensorEntry] = []
    spans: list[int] = []
    for b, group in enumerate(groups):
        major = [(k, t) for k, t in group if t.numel() * t.element_size() >= _MAJOR_SIZE]
        minor = [(k, t) for k, t in group if t.numel() * t.element_size() < _MAJOR_SIZE]
        offset = 0
        for i, (key, t) in enumerate(major + minor):
            nbytes = t.numel() * t.element_size()
            align = _MAJOR_ALIGN if nbytes >= _MAJOR_SIZE else _MINOR_ALIGN
            offset = -(-offset // align) * align
            entries.append(TensorEntry(key, tuple(t.shape), _dtype_name(t.dtype), b, i, offset, nbytes))
            offset += nbytes
        spans.append(offset)
    entries.sort(key=lambda e: e.key)
    digest = hashlib.sha1(repr(([tuple(e.__dict__.values()) for e in entries], spans)).encode())
    return Manifest(tuple(entries), tuple(spans), digest.hexdigest()[:16])


def cast_floating(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast every floating-point tensor to ``dtype`` (integers and bools stay as they are).

    Example:
        >>> cast = cast_floating({"w": torch.ones(2), "n": torch.ones(2, dtype=torch.int64)}, torch.bfloat16)
        >>> cast["w"].dtype, cast["n"].dtype
        (torch.bfloat16, torch.int64)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}


def same_bytes(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether two buckets (lists of uint8 arrays) hold exactly the same bytes.

    Example:
        >>> same_bytes([np.zeros(3, np.uint8)], [np.zeros(3, np.uint8)])
        True
    """
    if len(a) != len(b):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return all(
            x.nbytes == y.nbytes and (x.nbytes == 0 or torch.equal(torch.from_numpy(x), torch.from_numpy(y)))
            for x, y in zip(a, b, strict=True)
        )


def pack(tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> list[list[np.ndarray]]:
    """Uint8 numpy views of the tensors, grouped by bucket in buffer order. No copy.

    Hand each list to ``ray.put``: that is the one copy a version costs.
    Non-contiguous tensors are made contiguous first; GPU tensors are copied to
    the host.

    Example:
        >>> t = {"w": torch.ones(2)}
        >>> pack(t, plan_layout(t))[0][0].dtype
        dtype('uint8')
    """
    buckets: list[list[np.ndarray]] = [[] for _ in range(manifest.num_buckets)]
    for b in range(manifest.num_buckets):
        for entry in manifest.bucket_entries(b):
            buckets[b].append(_as_bytes(tensors[entry.key]))
    return buckets


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # the bytes of a lazy view are not its values
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy()


def bucket_checksums(buckets: Sequence[Sequence[np.ndarray]]) -> tuple[int, ...]:
    """One CRC32 per bucket over its tensors' bytes (padding excluded).

    Example:
        >>> t = {"w": torch.ones(2)}
        >>> len(bucket_checksums(pack(t, plan_layout(t))))
        1
    """
    out = []
    for arrays in buckets:
        crc = 0
        for a in arrays:
            if a.nbytes:
                crc = zlib.crc32(a.data.cast("B"), crc)
        out.append(crc)
    return tuple(out)


def require_checksums(manifest: Manifest) -> None:
    """Raise :class:`ChecksumError` unless the version carries checksums to verify.

    A subscriber that asked to verify (``verify=True``) must not take a
    version it cannot check: the pusher left the checksums out
    (``checksum=False``), or the version came over NIXL, which has none.

    Example:
        >>> require_checksums(plan_layout({"w": torch.ones(2)}))
        Traceback (most recent call last):
        ...
        raysync.errors.ChecksumError: this version (layout ...) carries no checksums, ...
    """
    if manifest.checksums is not None:
        return
    if manifest.transport == "nixl":
        raise ChecksumError(
            f"this version (layout {manifest.layout_hash}) came over NIXL, which carries no checksums "
            "(hub.push(..., transport='nixl') refuses checksum=), so a verify=True subscriber refuses it: "
            "push with hub.push(..., transport='object_store', checksum=True), or subscribe without "
            "verify=True"
        )
    raise ChecksumError(
        f"this version (layout {manifest.layout_hash}) carries no checksums, so a verify=True "
        "subscriber cannot check its bytes and refuses it: push with hub.push(..., checksum=True), "
        "or subscribe without verify=True"
    )


def verify_checksums(
    manifest: Manifest,
    buckets: Mapping[int, Sequence[np.ndarray]] | Sequence[Sequence[np.ndarray]],
) -> None:
    """Raise :class:`ChecksumError` if a bucket's bytes differ from the manifest's CRC.

    ``buckets`` is every bucket in order, or ``{index: arrays}`` for some of them.
    A version pushed without checksums is refused too (see
    :func:`require_checksums`): verifying it would check nothing.

    Example:
        >>> t = {"w": torch.ones(2)}
        >>> m = plan_layout(t)
        >>> buckets = pack(t, m)
        >>> verify_checksums(m.with_checksums(bucket_checksums(buckets)), buckets)
        >>> verify_checksums(m, buckets)
        Traceback (most recent call last):
        ...
        raysync.errors.ChecksumError: this version (layout ...) carries no checksums, ...
    """
    require_checksums(manifest)
    assert manifest.checksums is not None
    by_index = dict(buckets.items()) if isinstance(buckets, Mapping) else dict(enumerate(buckets))
    order = sorted(by_index)
    got = bucket_checksums([by_index[b] for b in order])
    bad = [b for b, have in zip(order, got, strict=True) if manifest.checksums[b] != have]
    if bad:
        raise ChecksumError(
            f"bucket(s) {bad} of layout {manifest.layout_hash} failed their checksum: "
            "the bytes were corrupted in transit or in the object store; the version is refused"
        )


# --------------------------------------------------------------------------- validate


def validate(manifest: Manifest, model_schema: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """Check a version against a model's ``{key: (shape, dtype)}``; report every problem at once.

    Raises:
        WeightMismatchError: listing missing, unexpected, mis-shaped and mis-typed keys.

    Example:
        >>> m = plan_layout({"w": torch.zeros(3)})
        >>> validate(m, {"w": ((2,), "float32")})
        Traceback (most recent call last):
        ...
        raysync.errors.WeightMismatchError: weights do not match the model: shape mismatch w: ...
    """
    pushed = manifest.schema()
    missing = sorted(set(model_schema) - set(pushed))
    unexpected = sorted(set(pushed) - set(model_schema))
    shapes = {
        k: (pushed[k][0], tuple(model_schema[k][0]))
        for k in sorted(set(pushed) & set(model_schema))
        if tuple(pushed[k][0]) != tuple(model_schema[k][0])
    }
    dtypes = {
        k: (pushed[k][1], model_schema[k][1])
        for k in sorted(set(pushed) & set(model_schema))
        if pushed[k][1] != model_schema[k][1]
    }
    if not (missing or unexpected or shapes or dtypes):
        return
    parts = []
    if missing:
        parts.append(f"missing keys {_short(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {_short(unexpected)}")
    parts += [f"shape mismatch {k}: pushed {a}, model {b}" for k, (a, b) in list(shapes.items())[:10]]
    parts += [f"dtype mismatch {k}: pushed {a}, model {b}" for k, (a, b) in list(dtypes.items())[:10]]
    raise WeightMismatchError(
        "weights do not match the model: " + "; ".join(parts),
        missing=missing,
        unexpected=unexpected,
        shape_mismatch=shapes,
        dtype_mismatch=dtypes,
    )


def _short(keys: list[str], limit: int = 20) -> str:
    return repr(keys) if len(keys) <= limit else f"{keys[:limit]!r} and {len(keys) - limit} more"


# --------------------------------------------------------------------------- unpack / apply


def unpack(
    manifest: Manifest, buckets: Sequence[Sequence[np.ndarray]], *, read_only: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors that view the bucket buffers, with their shapes and dtypes. No copy.

    Args:
        manifest: the version's manifest.
        buckets: what ``ray.get`` returned for the version's bucket refs.
        read_only: wrap each tensor as :class:`ReadOnlyTensor`, so in-place
            writes raise instead of changing shared memory.

    Example:
        >>> t = {"w": torch.arange(3.0)}
        >>> m = plan_layout(t)
        >>> unpack(m, pack(t, m))["w"]
        tensor([0., 1., 2.])
    """
    out: dict[str, torch.Tensor] = {}
    for entry in manifest.entries:
        arr = buckets[entry.bucket][entry.index]
        out[entry.key] = _tensor_from_bytes(arr, entry, read_only=read_only)
    return out


def _tensor_from_bytes(arr: np.ndarray, entry: TensorEntry, *, read_only: bool) -> torch.Tensor:
    if arr.nbytes != entry.nbytes:
        raise ChecksumError(
            f"tensor {entry.key!r} arrived with {arr.nbytes} bytes, the manifest says {entry.nbytes}"
        )
    with warnings.catch_warnings():
        # Object-store buffers are read-only numpy arrays; torch warns but shares them.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(arr) if arr.nbytes else torch.empty(0, dtype=torch.uint8)
    t = flat.view(entry.torch_dtype).reshape(entry.shape)
    return t.as_subclass(ReadOnlyTensor) if read_only else t


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


def _span(arrays: Sequence[np.ndarray], entries: Sequence[TensorEntry], nbytes: int) -> torch.Tensor | None:
    """One uint8 tensor over a whole bucket if Ray laid it out as planned, else None.

    The returned tensor aliases the object-store buffer; the caller must keep
    ``arrays`` alive while using it and must not write to it.
    """
    if not arrays or nbytes == 0:
        return None
    base = arrays[0].ctypes.data
    for arr, entry in zip(arrays, entries, strict=True):
        if arr.nbytes and arr.ctypes.data - base != entry.offset:
            return None
    raw = (ctypes.c_uint8 * nbytes).from_address(base)
    return torch.from_numpy(np.ctypeslib.as_array(raw))


class BoundModel:
    """A module whose parameters and buffers are laid out like a manifest's buckets.

    Binding allocates one flat buffer per bucket, copies the module's current
    values in, and re-points each parameter and buffer at its slice (the
    ``Parameter`` objects stay the same). Applying a version is then one
    ``copy_`` per bucket, and only for buckets whose bytes differ from those
    held (each bucket is known by an id: the ``ObjectRef`` it came from).
    With ``view=True`` nothing is allocated: applying swaps the parameters for
    read-only views of the received buffers.

    A second set of buffers (``stage`` then ``swap``) lets a version be copied
    in while the module is in use, and be made current by re-pointing.

    Extra state (``get_extra_state``/``set_extra_state``) is not in the
    buckets: pass a version's ``Manifest.extra_state`` to :meth:`apply`,
    :meth:`stage`, :meth:`mark_staged` or :meth:`adopt`, and each submodule's
    ``set_extra_state`` gets its object in the same step that makes the
    tensors current (before them: if one raises, those already set get their
    previous state back and the tensors do not change). A version without
    extra state leaves the module's own as it is.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> src = torch.nn.Linear(4, 2)
        >>> tensors = extract_tensors(src)
        >>> m = plan_layout(tensors)
        >>> bound = BoundModel(model, m)
        >>> bound.apply(pack(tensors, m))
        >>> torch.equal(model.weight, src.weight)
        True
    """

    def __init__(self, module: torch.nn.Module, manifest: Manifest, *, view: bool = False) -> None:
        validate(manifest, module_schema(module))
        self.module = module
        self.manifest = manifest
        self.view = view
        self._slots = {e.key: _slot(module, e.key) for e in manifest.entries}
        self._tree = _module_edges(module)
        self.device = _device_of(module, self._slots, view=view)
        self._held: Any = None  # view mode: the buffers the parameters point into
        self._flat: list[torch.Tensor] = []
        self._expected: list[tuple[dict[str, Any], str, int]] = []
        self.ids: list[str | None] = [None] * manifest.num_buckets  # what the live buffers hold
        self._spare: list[torch.Tensor] = []
        self.spare_ids: list[str | None] = [None] * manifest.num_buckets
        self._spare_extra: list[tuple[str, torch.nn.Module, Any]] = []  # the staged version's extra state
        if not view:
            self._flat = self._allocate()
            with torch.no_grad():
                for entry, target in self._views(self._flat):
                    owner, name, _ = self._slots[entry.key]
                    current = getattr(owner, name).detach()
                    if current.device.type != "meta":  # a weightless module: the first apply fills it
                        target.copy_(current)
            self._point_at(self._flat)

    @property
    def layout_hash(self) -> str:
        """The layout this binding was made for."""
        return self.manifest.layout_hash

    def _allocate(self) -> list[torch.Tensor]:
        return [torch.empty(n, dtype=torch.uint8, device=self.device) for n in self.manifest.bucket_nbytes]

    def intact(self) -> bool:
        """Whether every parameter and buffer still is the tensor this binding set.

        False once user code re-pointed one (``load_state_dict(..., assign=True)``,
        ``module.to(...)``, ``.double()``, a replaced submodule): applies would then
        go where the module no longer looks. Costs one pointer compare per tensor.
        """
        with torch._C.DisableTorchFunctionSubclass():
            for slots, name, ptr in self._expected:
                t = slots.get(name)
                if t is None or t.data_ptr() != ptr:
                    return False
        return all(children.get(name) is child for children, name, child in self._tree)

    def _expect(self) -> None:
        """Remember what each parameter and buffer points at now (see :meth:`intact`)."""
        with torch._C.DisableTorchFunctionSubclass():
            self._expected = []
            for owner, name, is_param in self._slots.values():
                slots = owner._parameters if is_param else owner._buffers
                t = slots[name]
                assert t is not None
                self._expected.append((slots, name, t.data_ptr()))

    def _views(self, flat: list[torch.Tensor]) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
        for entry in self.manifest.entries:
            target = flat[entry.bucket][entry.offset : entry.offset + entry.nbytes]
            yield entry, target.view(entry.torch_dtype).reshape(entry.shape)

    def _point_at(self, flat: list[torch.Tensor]) -> None:
        for entry, target in self._views(flat):
            owner, name, is_param = self._slots[entry.key]
            if is_param:
                owner._parameters[name].data = target  # type: ignore[union-attr]
            else:
                owner._buffers[name] = target
        self._expect()

    def needed(self, ids: Sequence[str | None], *, staging: bool = False) -> list[int]:
        """Indices of the buckets whose bytes differ from those held (live or spare set)."""
        if self.view:
            return list(range(self.manifest.num_buckets))
        held = self.spare_ids if staging else self.ids
        return [b for b, i in enumerate(ids) if i is None or held[b] != i]

    def apply(
        self,
        buckets: Mapping[int, Sequence[np.ndarray]] | Sequence[Sequence[np.ndarray]],
        ids: Sequence[str | None] | None = None,
        *,
        extra_state: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Make the module hold the bytes of ``buckets`` (same layout as the binding).

        ``buckets`` maps bucket index to its arrays (or is a list of all of
        them); buckets left out must be ones the module already holds. Call
        :func:`validate` and :func:`verify_checksums` first; after them
        nothing here can fail part-way, but for a ``set_extra_state`` that
        raises (then nothing changes).

        Args:
            buckets: the version's buckets (or those the module lacks).
            ids: an identity per bucket (see :meth:`needed`).
            extra_state: the version's ``Manifest.extra_state``.

        Raises:
            WeightMismatchError: ``extra_state`` names a submodule the module
                lacks, or one without ``set_extra_state``.
        """
        by_index = dict(buckets.items()) if isinstance(buckets, Mapping) else dict(enumerate(buckets))
        ids = list(ids) if ids is not None else [None] * self.manifest.num_buckets
        extras = _extra_targets(self.module, extra_state)  # unpickled and checked before any change
        if self.view:
            all_buckets = [by_index[b] for b in range(self.manifest.num_buckets)]
            tensors = unpack(self.manifest, all_buckets, read_only=True)
            _set_extra_state(extras)
            for key, t in tensors.items():
                owner, name, is_param = self._slots[key]
                if is_param:
                    # Shared read-only weights cannot be trained: no gradient.
                    owner._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
                else:
                    owner._buffers[name] = t
            self._held = all_buckets
            self.ids = ids
            self._expect()
            return
        _set_extra_state(extras)
        self._copy_into(self._flat, by_index)
        for b in by_index:
            self.ids[b] = ids[b]

    def stage(
        self,
        buckets: Mapping[int, Sequence[np.ndarray]],
        ids: Sequence[str | None],
        *,
        extra_state: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Copy a version into the spare buffers (the module keeps using the live ones).

        ``extra_state`` (the version's ``Manifest.extra_state``) is unpickled
        here and set by :meth:`swap`.
        """
        if self.view:
            raise RuntimeError("staging needs apply='copy'")
        extras = _extra_targets(self.module, extra_state)
        if not self._spare:
            self._spare = self._allocate()
            self.spare_ids = [None] * self.manifest.num_buckets
        missing = [b for b in self.needed(ids, staging=True) if b not in buckets]
        if missing:
            raise ValueError(f"stage() needs bucket(s) {missing}: the spare buffers do not hold them")
        self._copy_into(self._spare, buckets)
        for b in buckets:
            self.spare_ids[b] = ids[b]
        self._spare_extra = extras

    def buffers(self, *, spare: bool = False) -> list[torch.Tensor]:
        """The flat bucket buffers (live, or the spare set, allocated on first use)."""
        if self.view:
            raise RuntimeError("apply='view' has no buffers of its own")
        if spare and not self._spare:
            self._spare = self._allocate()
            self.spare_ids = [None] * self.manifest.num_buckets
        return self._spare if spare else self._flat

    def mark_staged(
        self,
        indices: Sequence[int],
        ids: Sequence[str | None],
        *,
        extra_state: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Record that the spare buffers now hold ``ids`` for these buckets (filled from outside).

        ``extra_state`` is the staged version's ``Manifest.extra_state``, set by :meth:`swap`.
        """
        extras = _extra_targets(self.module, extra_state)
        for b in indices:
            self.spare_ids[b] = ids[b]
        self._spare_extra = extras

    def adopt(
        self,
        flat: Sequence[torch.Tensor],
        ids: Sequence[str | None] | None = None,
        *,
        extra_state: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Make outside buffers (one flat uint8 tensor per bucket) live: re-point, no copy.

        The ``Parameter`` objects stay the same; the caller keeps ``flat``
        unchanged while the module uses it (e.g. a shared-memory snapshot).
        ``extra_state`` is the version's ``Manifest.extra_state``.
        """
        if self.view:
            raise RuntimeError("adopt() needs apply='copy'")
        sizes = [int(t.numel()) for t in flat]
        if sizes != list(self.manifest.bucket_nbytes) or any(t.dtype != torch.uint8 for t in flat):
            raise ValueError(
                f"adopt() needs uint8 buffers of {list(self.manifest.bucket_nbytes)} bytes, got {sizes}"
            )
        _set_extra_state(_extra_targets(self.module, extra_state))
        self._point_at(list(flat))
        self._flat = list(flat)
        self.ids = list(ids) if ids is not None else [None] * self.manifest.num_buckets

    def swap(self) -> None:
        """Make the staged version current: set its extra state, re-point every parameter, no copy."""
        _set_extra_state(self._spare_extra)
        self._spare_extra = []
        self._point_at(self._spare)
        self._flat, self._spare = self._spare, self._flat
        self.ids, self.spare_ids = self.spare_ids, self.ids

    def _copy_into(self, flat: list[torch.Tensor], buckets: Mapping[int, Sequence[np.ndarray]]) -> None:
        with torch.no_grad():
            for b, arrays in buckets.items():
                entries = self.manifest.bucket_entries(b)
                src = _span(arrays, entries, self.manifest.bucket_nbytes[b])
                if src is not None:
                    flat[b].copy_(src)
                    continue
                for entry, arr in zip(entries, arrays, strict=True):
                    if entry.nbytes:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", UserWarning)
                            flat[b][entry.offset : entry.offset + entry.nbytes].copy_(torch.from_numpy(arr))


def _extra_targets(
    module: torch.nn.Module, extra_state: Sequence[tuple[str, bytes]]
) -> list[tuple[str, torch.nn.Module, Any]]:
    """``(key, submodule, object)`` for a version's extra state; raises before anything changes."""
    if not extra_state:
        return []
    base = torch.nn.Module.set_extra_state
    targets: list[tuple[str, torch.nn.Module, bytes]] = []
    unexpected: list[str] = []
    for key, data in extra_state:
        prefix = key[: -len(_EXTRA)].rstrip(".")
        try:
            sub = module.get_submodule(prefix) if prefix else module
        except AttributeError:
            unexpected.append(key)
            continue
        if getattr(type(sub), "set_extra_state", base) is base:
            unexpected.append(key)
            continue
        targets.append((key, sub, data))
    if unexpected:
        raise WeightMismatchError(
            f"weights do not match the model: the version carries extra state for {_short(unexpected)}, "
            f"which {type(module).__name__} has no submodule with set_extra_state() for",
            unexpected=unexpected,
        )
    out = []
    for key, sub, data in targets:
        try:
            out.append((key, sub, pickle.loads(data)))
        except Exception as err:
            raise InvalidWeightsError(
                f"the extra state of {key!r} cannot be unpickled here ({type(err).__name__}: {err}): "
                "the classes it holds must be importable in every receiver"
            ) from err
    return out


def _set_extra_state(targets: Sequence[tuple[str, torch.nn.Module, Any]]) -> None:
    """Hand each submodule its object; if one raises, put the earlier ones back, then re-raise."""
    base = torch.nn.Module.get_extra_state
    done: list[tuple[torch.nn.Module, Any]] = []
    try:
        for _key, sub, state in targets:
            has_state = getattr(type(sub), "get_extra_state", base) is not base
            before = copy.deepcopy(sub.get_extra_state()) if has_state else None
            sub.set_extra_state(state)
            if has_state:
                done.append((sub, before))
    except Exception:
        for sub, before in reversed(done):
            try:
                sub.set_extra_state(before)
            except Exception as err:  # keep the first error; this one only gets logged
                logger.warning("could not restore the extra state of %s: %s", type(sub).__name__, err)
        raise


def module_schema(module: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype)}`` of a module's state dict (parameters and persistent buffers).

    Extra state (``"..._extra_state"`` entries) is not part of it.

    Example:
        >>> module_schema(torch.nn.Linear(2, 1))
        {'weight': ((1, 2), 'float32'), 'bias': ((1,), 'float32')}
    """
    return schema_of(_module_tensors(module, keep_vars=True))


def _module_edges(module: torch.nn.Module) -> list[tuple[dict[str, Any], str, torch.nn.Module]]:
    """``(parent._modules, name, child)`` for every submodule: a replaced one shows as a changed edge."""
    edges = []
    for parent in module.modules():
        for name, child in parent._modules.items():
            if child is not None:
                edges.append((parent._modules, name, child))
    return edges


def _device_of(
    module: torch.nn.Module, slots: Mapping[str, tuple[torch.nn.Module, str, bool]], *, view: bool
) -> torch.device:
    """The one device a bound module's weights live on (a meta module is filled on the CPU)."""
    devices = {getattr(owner, name).device for owner, name, _ in slots.values()}
    devices.discard(torch.device("meta"))
    if len(devices) > 1:
        raise InvalidWeightsError(
            f"{type(module).__name__} has weights on several devices ({sorted(map(str, devices))}): "
            "a synced module lives on one device; move it there first (module.to(device))"
        )
    device = devices.pop() if devices else torch.device("cpu")
    if view and device.type != "cpu":
        raise InvalidWeightsError(
            f"apply='view' shares the object store's CPU memory, but {type(module).__name__} is on "
            f"{device}: use apply='copy' for modules on an accelerator"
        )
    return device


def _slot(module: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str, bool]:
    prefix, _, name = key.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    if name in owner._parameters:
        return owner, name, True
    if name in owner._buffers:
        return owner, name, False
    raise InvalidWeightsError(f"{key!r} is neither a parameter nor a buffer of {type(module).__name__}")


# --------------------------------------------------------------------------- read-only views

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
_SPECS: dict[Any, _WriteSpec] = {}
_MAX_SPECS = 4096  # functions seen; bounded in case some are made on the fly


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
        with torch._C.DisableTorchFunctionSubclass():
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
        if isinstance(func, torch._ops.OpOverloadPacket):  # torch.ops.aten.add_
            return [getattr(func, o)._schema for o in func.overloads()]
        if base and isinstance(func, (BuiltinFunctionType, MethodDescriptorType)):
            # torch.add_, Tensor.add_, torch._fused_adam_: bindings generated from ATen, same arguments.
            packet = getattr(torch.ops.aten, base, None)
            if isinstance(packet, torch._ops.OpOverloadPacket):
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


# --------------------------------------------------------------------------- dtypes


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidWeightsError(f"unknown dtype {name!r} in a manifest")
    return dtype
