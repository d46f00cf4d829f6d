"""A module bound to a layout: its parameters are views of flat bucket buffers.

Applying a version is then one ``copy_`` per bucket (or, with ``view=True``, a
pointer swap to read-only views of received buffers).
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from raysync import _compat
from raysync._compat import version_counters
from raysync.core import codec
from raysync.core.codec import unpack
from raysync.core.extract import module_schema
from raysync.core.layout import _EXTRA, Manifest, _short, validate
from raysync.core.readonly_pages import read_only_buckets
from raysync.errors import InvalidWeightsError, WeightMismatchError

__all__ = ["BoundModel"]

logger = logging.getLogger(__name__)


class BoundModel:
    """A module whose parameters and buffers are laid out like a manifest's buckets.

    Binding allocates one flat buffer per bucket, copies the module's current
    values in, and re-points each parameter and buffer at its slice (the
    ``Parameter`` objects stay the same). Applying a version is then one
    ``copy_`` per bucket, and only for buckets whose bytes differ from those
    held (each bucket is known by an id: the ``ObjectRef`` it came from).
    With ``view=True`` nothing is allocated: applying swaps the parameters for
    read-only views of the received buffers.

    The version's keys are the module's state dict keys; with
    ``non_persistent=True`` also its non-persistent buffers (the keys
    ``extract_tensors(module, non_persistent=True)`` gives, as
    ``TensorDict.from_module``), which then take the version's values too.

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

    def __init__(
        self, module: torch.nn.Module, manifest: Manifest, *, view: bool = False, non_persistent: bool = False
    ) -> None:
        validate(manifest, module_schema(module, non_persistent=non_persistent))
        self.module = module
        self.manifest = manifest
        self.view = view
        self._slots = {e.key: _slot(module, e.key) for e in manifest.entries}
        self._tree = _module_edges(module)
        self.device = _device_of(module, self._slots, view=view)
        self._held: Any = None  # view mode: the buffers the parameters point into
        self._flat: list[torch.Tensor] = []
        self._expected: list[tuple[dict[str, Any], str, int]] = []
        self._tensors: list[torch.Tensor] = []  # per _expected entry: the tensor bound
        self._bucket_of: list[int] = []  # per _expected tensor: its bucket
        self._owner_of: list[int] = []  # per _expected tensor: its submodule (an index into _owner_buckets)
        self._owner_buckets: list[set[int]] = []  # per submodule: the buckets of its own tensors
        self._clean: list[int] = []  # per _expected tensor: its version counter when last applied
        self.ids: list[str | None] = [None] * manifest.num_buckets  # what the live buffers hold
        self._spare: list[torch.Tensor] = []
        self.spare_ids: list[str | None] = [None] * manifest.num_buckets
        self._spare_extra: list[tuple[str, torch.nn.Module, Any]] = []  # the staged version's extra state
        if not view:
            self._flat = codec.allocate(manifest, device=self.device)
            current = {key: getattr(owner, name) for key, (owner, name, _) in self._slots.items()}
            if not any(t.device.type == "meta" for t in current.values()):  # weightless: the apply fills it
                codec.write(current, manifest, self._flat)
            self._point_at(self._flat)

    @property
    def layout_hash(self) -> str:
        """The layout this binding was made for."""
        return self.manifest.layout_hash

    def intact(self) -> bool:
        """Whether every parameter and buffer still is the tensor this binding set.

        False once user code re-pointed one (``load_state_dict(..., assign=True)``,
        ``module.to(...)``, ``.double()``, a replaced submodule): applies would then
        go where the module no longer looks. Costs one pointer compare per tensor.
        """
        with _compat.plain_tensors():
            for slots, name, ptr in self._expected:
                t = slots.get(name)
                if t is None or t.data_ptr() != ptr:
                    return False
        return all(children.get(name) is child for children, name, child in self._tree)

    def _expect(self) -> None:
        """Remember what each parameter and buffer points at now (see :meth:`intact`), all as applied."""
        bucket = {e.key: e.bucket for e in self.manifest.entries}
        owners: dict[int, int] = {}
        with _compat.plain_tensors():
            self._expected, self._tensors, self._bucket_of, self._owner_of = [], [], [], []
            self._owner_buckets = []
            for key, (owner, name, is_param) in self._slots.items():
                slots = owner._parameters if is_param else owner._buffers
                t = slots[name]
                assert t is not None
                self._expected.append((slots, name, t.data_ptr()))
                self._tensors.append(t)
                self._bucket_of.append(bucket[key])
                index = owners.setdefault(id(owner), len(owners))
                if index == len(self._owner_buckets):
                    self._owner_buckets.append(set())
                self._owner_buckets[index].add(bucket[key])
                self._owner_of.append(index)
        self.mark_clean()

    def _counters(self) -> list[int]:
        """The version counter of each tensor bound (a re-pointed one is :meth:`intact`'s to find)."""
        with _compat.plain_tensors():
            return version_counters(self._tensors)

    def mark_clean(self, buckets: Iterable[int] | None = None) -> None:
        """Take what the tensors of ``buckets`` (default: all) hold now as the applied version's.

        :meth:`written` compares against this. Called after each apply: raysync's own
        ``copy_`` counts as an in-place write too.
        """
        now = self._counters()
        if buckets is None or len(self._clean) != len(now):
            self._clean = now
            return
        chosen = set(buckets)
        self._clean = [
            n if b in chosen else c for n, c, b in zip(now, self._clean, self._bucket_of, strict=True)
        ]

    def written(self) -> list[int]:
        """Buckets to take again because a tensor was changed in place since it was applied (sorted).

        A submodule with one tensor changed counts as changed whole: the buckets of
        all its own parameters and buffers are returned. Exact for every in-place
        write through the module's tensors (``add_``, ``copy_``, optimizer steps,
        ``num_batches_tracked += 1``, indexed assignment), under ``no_grad`` and
        ``inference_mode`` too; one integer read per tensor (torch's version
        counters, see :mod:`raysync._compat`). Not seen: writes through
        ``tensor.data`` or raw memory (numpy views), and writes by kernels that do
        not declare them, unless their submodule changes another tensor too: batch
        norm's update of ``running_mean`` and ``running_var`` in training mode is
        seen through its ``num_batches_tracked += 1``.

        Example:
            >>> with torch.no_grad():
            ...     model.weight.add_(1)
            >>> bound.written()
            [0]
        """
        now = self._counters()
        if now == self._clean:
            return []
        if len(now) != len(self._clean):
            return sorted(set(self._bucket_of))
        owners = {o for n, c, o in zip(now, self._clean, self._owner_of, strict=True) if n != c}
        return sorted({b for o in owners for b in self._owner_buckets[o]})

    def _point_at(self, flat: list[torch.Tensor]) -> None:
        for key, target in codec.views(self.manifest, flat).items():
            owner, name, is_param = self._slots[key]
            if is_param:
                param = owner._parameters[name]
                assert param is not None
                if param.device.type == "meta":  # a weightless module: a real parameter in its place
                    owner._parameters[name] = torch.nn.Parameter(target, requires_grad=param.requires_grad)
                else:
                    param.data = target
            else:
                owner._buffers[name] = target
        self._expect()

    def needed(self, ids: Sequence[str | None], *, staging: bool = False, written: bool = True) -> list[int]:
        """Indices of the buckets whose bytes differ from those held (live or spare set).

        With ``written`` (the default), live buckets changed in place since they were
        applied (:meth:`written`) are needed too, whatever their ids.
        """
        if self.view:
            return list(range(self.manifest.num_buckets))
        held = self.spare_ids if staging else self.ids
        changed = set(self.written()) if written and not staging else set()
        return [b for b, i in enumerate(ids) if i is None or held[b] != i or b in changed]

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
            # on pages mapped read-only here: no route (as_subclass, dlpack, raw memory) can write them
            all_buckets = read_only_buckets([by_index[b] for b in range(self.manifest.num_buckets)])
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
        codec.copy_into(self._flat, self.manifest, by_index)
        for b in by_index:
            self.ids[b] = ids[b]
        self.mark_clean(by_index)

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
        spare = self.buffers(spare=True)
        missing = [b for b in self.needed(ids, staging=True) if b not in buckets]
        if missing:
            raise ValueError(f"stage() needs bucket(s) {missing}: the spare buffers do not hold them")
        codec.copy_into(spare, self.manifest, buckets)
        for b in buckets:
            self.spare_ids[b] = ids[b]
        self._spare_extra = extras

    def buffers(self, *, spare: bool = False) -> list[torch.Tensor]:
        """The flat bucket buffers (live, or the spare set, allocated on first use)."""
        if self.view:
            raise RuntimeError("apply='view' has no buffers of its own")
        if spare and not self._spare:
            self._spare = codec.allocate(self.manifest, device=self.device)
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
        for b in self.written():  # the live set becomes the spare one: it no longer holds those ids
            self.ids[b] = None
        self._point_at(self._spare)
        self._flat, self._spare = self._spare, self._flat
        self.ids, self.spare_ids = self.spare_ids, self.ids


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
