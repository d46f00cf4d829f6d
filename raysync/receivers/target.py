"""What a receiver applies a version into: a :class:`Target`, and the module one (the default).

A target says what it holds (so a version is checked against it before any byte is
fetched: :meth:`Target.check`), which buckets it lacks (:meth:`Target.needed`), and how a
fetched and verified version goes in, whole or not at all (:meth:`Target.commit`, handed
an :class:`Incoming`). :mod:`raysync.receivers.pipeline` drives every receiver through
these calls. :class:`ModuleTarget` binds an ``nn.Module`` (a copy into its own buffers,
or read-only views of the store: :class:`~raysync.core.bound.BoundModel`);
:class:`~raysync.receivers.loader.WeightsLoader` hands ``(name, tensor)`` pairs to a
callable, as inference engines' ``load_weights`` take them.

Example:
    >>> target = ModuleTarget(torch.nn.Linear(4, 2))
    >>> target.check(manifest)                       # WeightMismatchError names each misfit
    >>> needed = target.needed(manifest, ids)        # the buckets to fetch
    >>> target.commit(Incoming(3, manifest, ids, fetched))   # whole or not at all
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from raysync.core.bound import BoundModel
from raysync.core.codec import tensor_of
from raysync.core.extract import extract_tensors, module_schema
from raysync.core.layout import Manifest, TensorEntry, schema_of, validate
from raysync.core.placement import TensorParallel
from raysync.errors import RaySyncError, WeightMismatchError

__all__ = ["Incoming", "ModuleTarget", "Schema", "Target", "TensorsTarget", "is_target", "weightless"]


Schema = Mapping[str, tuple[tuple[int, ...], str]]
"""``{name: (shape, dtype name)}``: what a target holds (what :func:`~raysync.core.layout.validate` takes)."""


@dataclass(frozen=True)
class Incoming:
    """One version's fetched and verified buckets, as a target's :meth:`~Target.commit` gets them.

    Only the buckets the target said it lacks are here (:meth:`Target.needed`): all of
    them for a first version or a new layout, the changed ones for a ``keys=`` or
    ``delta=`` push. The arrays are the transport's (zero-copy views of the object store
    for ``object_store``): read them during ``commit``, keep copies only.

    Attributes:
        version: the version's number.
        manifest: its layout (every tensor, every bucket).
        ids: one identity per bucket (the same id, the same bytes).
        buckets: ``{bucket index: arrays}`` of the buckets fetched.

    Example:
        >>> for name, tensor in incoming.tensors():     # read-only views, sorted by name
        ...     engine_param[name].copy_(tensor)
        >>> incoming.raw("layer.weight").nbytes         # a tensor's bytes, for byte-range consumers
    """

    version: int
    manifest: Manifest
    ids: Sequence[str | None]
    buckets: Mapping[int, Sequence[np.ndarray]]

    def entries(self) -> list[TensorEntry]:
        """The manifest's entries whose bucket is here, sorted by name."""
        return [e for e in self.manifest.entries if e.bucket in self.buckets]

    def names(self) -> list[str]:
        """The names of the tensors here, sorted."""
        return [e.key for e in self.entries()]

    def _entry(self, name: str) -> TensorEntry:
        for entry in self.manifest.entries:
            if entry.key == name:
                if entry.bucket not in self.buckets:
                    raise KeyError(
                        f"{name!r} is in bucket {entry.bucket}, which was not fetched (held already)"
                    )
                return entry
        raise KeyError(f"version {self.version} has no tensor {name!r}")

    def tensor(self, name: str, *, read_only: bool = True) -> torch.Tensor:
        """One tensor, viewing the fetched bytes (read-only unless ``read_only=False``). No copy."""
        entry = self._entry(name)
        return tensor_of(entry, self.buckets[entry.bucket], read_only=read_only)

    def tensors(self, *, read_only: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every tensor here, sorted by name: views of the fetched bytes."""
        for entry in self.entries():
            yield entry.key, tensor_of(entry, self.buckets[entry.bucket], read_only=read_only)

    def raw(self, name: str) -> np.ndarray:
        """One tensor's bytes (a flat uint8 array over the fetched buffer). No copy."""
        entry = self._entry(name)
        return np.asarray(self.buckets[entry.bucket][entry.index]).reshape(-1).view(np.uint8)


@runtime_checkable
class Target(Protocol):
    """Where a receiver puts versions: what it holds, and how a version goes in whole.

    The apply path (:mod:`raysync.receivers.pipeline`) calls, for each version newer than
    the one held: :meth:`check` (before any fetch), :meth:`needed`, then fetches and
    verifies those buckets, then :meth:`commit` once, under the receiver's write lock.
    A ``commit`` that raises must leave the target as it was, or make :meth:`intact`
    false (it then holds no version the receiver can report).

    A target that can read back the bytes it holds may say so: ``reads_back = True`` and
    ``held_bucket(manifest, bucket, bucket_id)``, the bytes of that bucket (flat uint8 numpy,
    padding included) if it holds exactly that one as applied, else None. Of a
    ``delta="sparse"`` version it then fetches, for such a bucket, only its patch and rebuilds
    the bucket (:func:`~raysync.transports.fetch.patchable`); other targets get whole buckets.

    Example:
        >>> class Printer:                      # the smallest target: takes anything, keeps nothing
        ...     def check(self, manifest): pass
        ...     def needed(self, manifest, ids): return list(range(manifest.num_buckets))
        ...     def commit(self, incoming): print(incoming.version, incoming.names())
        ...     def intact(self): return True
        ...     def forget(self): pass
        >>> isinstance(Printer(), Target)
        True
    """

    def check(self, manifest: Manifest) -> None:
        """Raise (:class:`~raysync.WeightMismatchError`, naming each tensor) unless the version fits."""
        ...

    def needed(self, manifest: Manifest, ids: Sequence[str | None]) -> list[int]:
        """The buckets (indices) to fetch: those whose bytes the target does not hold."""
        ...

    def commit(self, incoming: Incoming) -> None:
        """Make the version current, whole: every tensor of ``incoming`` or none."""
        ...

    def intact(self) -> bool:
        """Whether the target still holds what it last committed (user code or a torn load may undo it)."""
        ...

    def forget(self) -> None:
        """Hold nothing known any more: the next version is taken whole."""
        ...


def is_target(value: Any) -> bool:
    """Whether ``value`` is a :class:`Target` (and not a module: modules get a :class:`ModuleTarget`)."""
    return not isinstance(value, torch.nn.Module) and isinstance(value, Target)


class ModuleTarget:
    """The default target: an ``nn.Module``, bound to each layout by a :class:`BoundModel`.

    Args:
        module: the module, or a callable returning it (asked at each use: user code may
            replace the module, e.g. copy it onto a device).
        view: parameters become read-only views of the fetched buffers (``apply="view"``)
            instead of copies into the module's own memory.
        non_persistent: versions carry the module's non-persistent buffers too.
        materialize: a weightless module (``meta`` tensors) gets CPU memory
            (``to_empty``) before its first version.
        label: who holds it, for errors.
        placement: the module holds only its own parts of the tensors
            (:class:`~raysync.TensorParallel`, e.g. rank 1 of 2 of a tensor-parallel
            engine): it copies only its parts, whatever the trainer's layout (of a sharded
            trainer's versions it fetches only the ranks' buckets holding its parts; of one
            writer's, the buckets holding them). A version over a data path that hands out
            whole tensors only (NIXL) is refused, naming the tensors it would have to split.
            Copies only (not with ``view``).

    Example:
        >>> target = ModuleTarget(policy)
        >>> target.check(manifest); target.commit(Incoming(1, manifest, ids, buckets))
        >>> target.bound.layout_hash == manifest.layout_hash
        True
    """

    def __init__(
        self,
        module: torch.nn.Module | Callable[[], torch.nn.Module | None],
        *,
        view: bool = False,
        non_persistent: bool = False,
        materialize: bool = False,
        label: str = "the receiver",
        placement: TensorParallel | None = None,
    ) -> None:
        if placement is not None and not isinstance(placement, TensorParallel):
            raise TypeError(f"placement must be a raysync.TensorParallel, got {type(placement).__name__}")
        if placement is not None and view:
            raise ValueError(
                "placement= takes a module's own parts of each tensor, assembled from the trainer "
                "ranks' pieces: copies only, not views of the store (apply='copy')"
            )
        self.placement = placement
        if isinstance(module, torch.nn.Module):
            ref = module
            self._get: Callable[[], torch.nn.Module | None] = lambda: ref
        elif callable(module):
            self._get = module
        else:
            raise TypeError(
                f"module must be an nn.Module or a callable returning one, got {type(module).__name__}"
            )
        self.view = view
        self.non_persistent = non_persistent
        self.materialize = materialize
        self.label = label
        self.bound: BoundModel | None = None

    @property
    def module(self) -> torch.nn.Module:
        """The module now (raises if there is none to apply to)."""
        module = self._get()
        if not isinstance(module, torch.nn.Module):
            raise RaySyncError(
                f"{self.label} has no module to apply a version to (found {type(module).__name__})"
            )
        return module

    def schema(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """What the module holds: ``{key: (shape, dtype)}``."""
        return module_schema(self.module, non_persistent=self.non_persistent)

    def binding(self, manifest: Manifest) -> BoundModel | None:
        """The binding to re-use for ``manifest``: same module, same layout (intact or not)."""
        bound = self.bound
        if bound is None or bound.module is not self._get() or bound.layout_hash != manifest.layout_hash:
            return None
        return bound

    def _live(self, manifest: Manifest) -> BoundModel | None:
        bound = self.binding(manifest)
        return bound if bound is not None and bound.intact() else None

    def bind(self, manifest: Manifest) -> BoundModel:
        """A fresh binding of the module to ``manifest``'s layout (validated), made current."""
        module = self.module
        if self.materialize and self.bound is None and weightless(module, self.non_persistent):
            module.to_empty(device="cpu")  # the version being applied fills it before anything reads it
        self.bound = BoundModel(module, manifest, view=self.view, non_persistent=self.non_persistent)
        return self.bound

    def check(self, manifest: Manifest) -> None:
        # A version not cut into parts (see transports.fetch.view): whole tensors only.
        if self.placement is not None and manifest.shards is None:
            self._refuse_whole(manifest, self.placement)
        if self._live(manifest) is None:
            validate(manifest, self.schema())

    def _refuse_whole(self, manifest: Manifest, placement: TensorParallel) -> None:
        """A version not cut into parts (NIXL's whole buffers), which a module holding parts cannot take."""
        split = {}
        for e in manifest.entries:
            box = placement.box(e.key, tuple(e.shape))
            if box is not None and box[1] != tuple(e.shape):
                split[e.key] = (tuple(e.shape), box[1])
        if split:
            named = ", ".join(f"{k} {a} (its part {b})" for k, (a, b) in list(split.items())[:5])
            raise WeightMismatchError(
                f"{self.label} holds its parts of each tensor ({placement}), but this version's data "
                f"path ({manifest.transport!r}) hands out whole tensors only: {named}"
                f"{' ...' if len(split) > 5 else ''}; push to receivers with placement= over the object "
                "store (the default) or from a sharded trainer",
                shape_mismatch=split,
            )

    @property
    def reads_back(self) -> bool:
        """Whether it hands out the bytes it holds (:meth:`held_bucket`): copies, whole tensors."""
        return not self.view and self.placement is None

    def held_bucket(self, manifest: Manifest, bucket: int, bucket_id: str) -> np.ndarray | None:
        """Bucket ``bucket``'s bytes as held (flat uint8, read them only) if it holds ``bucket_id``
        as applied (not changed in place since), in CPU memory; else None."""
        bound = self._live(manifest)
        if (
            bound is None
            or not self.reads_back
            or bound.device.type != "cpu"
            or bound.ids[bucket] != bucket_id
        ):
            return None
        return None if bucket in bound.written() else bound.buffers()[bucket].numpy()

    def needed(self, manifest: Manifest, ids: Sequence[str | None], *, written: bool = True) -> list[int]:
        bound = self._live(manifest)
        if bound is None:
            return list(range(manifest.num_buckets))
        return bound.needed(ids, written=written)

    def commit(self, incoming: Incoming) -> None:
        manifest, ids = incoming.manifest, incoming.ids
        bound = self._live(manifest) or self.bind(manifest)
        missing = [b for b in bound.needed(ids, written=False) if b not in incoming.buckets]
        if missing:
            raise RaySyncError(
                f"bucket(s) {missing} changed while version {incoming.version} was fetched; retry"
            )
        bound.apply(incoming.buckets, ids, extra_state=manifest.extra_state)

    def intact(self) -> bool:
        bound = self.bound
        return bound is None or (bound.module is self._get() and bound.intact())

    def forget(self) -> None:
        self.bound = None


class TensorsTarget:
    """A state dict or ``TensorDict`` as a target: each version is copied into its tensors.

    Its tensors are looked up at each use (user code may replace an entry). A version is
    checked against them (keys, shapes, dtypes) before any byte is fetched, every bucket is
    fetched, and the commit copies every tensor in: a checked version cannot fail half-way.

    Example:
        >>> weights = {"w": torch.zeros(2)}
        >>> target = TensorsTarget(weights)
        >>> target.check(manifest); target.commit(Incoming(1, manifest, ids, buckets))  # doctest: +SKIP
    """

    def __init__(self, tensors: Any) -> None:
        self.ref = tensors

    def schema(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """What it holds: ``{key: (shape, dtype)}``."""
        return schema_of(extract_tensors(self.ref))

    def check(self, manifest: Manifest) -> None:
        validate(manifest, self.schema())

    def needed(self, manifest: Manifest, ids: Sequence[str | None]) -> list[int]:
        return list(range(manifest.num_buckets))

    def commit(self, incoming: Incoming) -> None:
        dest = extract_tensors(self.ref)
        validate(incoming.manifest, schema_of(dest))
        with torch.no_grad():
            for name, tensor in incoming.tensors():
                dest[name].copy_(tensor)

    def intact(self) -> bool:
        return True

    def forget(self) -> None:
        pass


def weightless(module: torch.nn.Module, non_persistent: bool) -> bool:
    """Whether the weights a version fills are on the meta device (no memory yet); with
    ``non_persistent``, whether any of its parameters or buffers is."""
    held: list[Any] = list(module.state_dict().values())
    if non_persistent:
        held += list(module.buffers())
    return any(t.is_meta for t in held if torch.is_tensor(t))
