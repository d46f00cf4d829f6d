"""``WeightsLoader``: a target that hands each version to a callable as ``(name, tensor)`` pairs.

The shape inference engines load weights in: vLLM's ``model.load_weights(weights)``
and ``worker.reload_weights(weights_iterator=...)`` take an iterable of
``(name, torch.Tensor)``. The callable is called once per version, only after every
bucket it needs was fetched and verified: a version that fails to arrive never reaches
it. What it accepts (names, shapes, dtypes) can be said up front, so a version that
names an unknown tensor or a misfit shape is refused before anything is fetched.

Example:
    >>> loader = raysync.WeightsLoader(llm_model.load_weights, expected=llm_model.state_dict())
    >>> follower = raysync.Follower(target=loader, model_id="policy").start()  # doctest: +SKIP
    >>> loader.version  # the version the engine holds  # doctest: +SKIP
    4
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from raysync.core.layout import Manifest, _dtype_name, validate
from raysync.core.placement import TensorParallel
from raysync.errors import WeightMismatchError
from raysync.receivers.target import Incoming

__all__ = ["Accepts", "Expected", "WeightsLoader"]

logger = logging.getLogger(__name__)


Accepts = Callable[[str, tuple[int, ...], torch.dtype], bool]
"""``(name, shape, dtype) -> bool``: whether a loader takes that tensor."""


Expected = Mapping[str, Any] | Accepts
"""What a loader takes: ``{name: tensor | (shape, dtype)}`` (a ``state_dict()``, say), or :data:`Accepts`."""


class WeightsLoader:
    """A :class:`~raysync.receivers.target.Target` fed through ``load_weights(iterable of (name, tensor))``.

    Args:
        load_weights: called once per version with an iterable of ``(name, tensor)``:
            every tensor of a first version (or of a new layout, such as the first
            ``keys=`` push, which lays those keys out apart), then those of the
            buckets that changed (the next ``keys=`` pushes: the keys pushed). The tensors are
            read-only views of the fetched bytes, valid during the call: copy them in
            (``param.copy_(t)``), never keep or write them.
        expected: what it takes, checked before anything is fetched: a mapping of
            name to a tensor or a ``(shape, dtype)`` pair (names outside it, other
            shapes or dtypes are refused; names it has that a version lacks are left
            alone), or a callable ``(name, shape, dtype) -> bool``. ``None`` takes
            every tensor.
        name: who this is in logs and errors.
        placement: this receiver's own placement (:class:`~raysync.TensorParallel`): it
            takes only its parts of each tensor (``expected`` then names the parts'
            shapes), fetching only the buckets that hold them (a sharded trainer's ranks'
            or one writer's). NIXL versions of one writer come whole.

    A version is refused (:class:`~raysync.WeightMismatchError`, naming each tensor)
    when it does not fit ``expected`` or carries extra state (``get_extra_state``
    objects, which only modules take). If ``load_weights`` raises, what the engine
    holds is unknown: the loader then reports no version, and the next version is
    handed over whole.

    Attributes:
        version: the version ``load_weights`` last took whole (``None`` before).

    Example:
        >>> params = dict(engine.named_parameters())
        >>> def load(weights):
        ...     for name, t in weights:
        ...         params[name].data.copy_(t)
        >>> loader = WeightsLoader(load, expected=params)
    """

    def __init__(
        self,
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
        expected: Expected | None = None,
        *,
        name: str | None = None,
        placement: TensorParallel | None = None,
    ) -> None:
        if placement is not None and not isinstance(placement, TensorParallel):
            raise TypeError(f"placement must be a raysync.TensorParallel, got {type(placement).__name__}")
        self.placement = placement
        if not callable(load_weights):
            raise TypeError(f"load_weights must be callable, got {type(load_weights).__name__}")
        self.load_weights = load_weights
        self.name = name or getattr(load_weights, "__qualname__", "WeightsLoader")
        self._schema: dict[str, tuple[tuple[int, ...], str]] | None = None
        self._accepts: Accepts | None = None
        if isinstance(expected, Mapping):
            self._schema = {str(k): _shape_dtype(k, v) for k, v in expected.items()}
        elif callable(expected):
            self._accepts = expected
        elif expected is not None:
            raise TypeError(
                f"expected must be a mapping of name to tensor or (shape, dtype), or a callable "
                f"(name, shape, dtype) -> bool; got {type(expected).__name__}"
            )
        self.version: int | None = None
        self._layout: str | None = None
        self._ids: list[str | None] = []
        self._torn = False

    def __repr__(self) -> str:
        return f"WeightsLoader({self.name}, version={self.version})"

    # ------------------------------------------------------------------ Target
    def check(self, manifest: Manifest) -> None:
        """Refuse a version this loader does not take, naming every tensor that does not fit."""
        validate(
            manifest, self._schema, who=str(self.name), partial=True, accepts=self._accepts, extra_state=False
        )

    def needed(self, manifest: Manifest, ids: Sequence[str | None]) -> list[int]:
        """Every bucket of a first version or a new layout; after that, the buckets that changed."""
        if self._layout != manifest.layout_hash or len(self._ids) != manifest.num_buckets:
            return list(range(manifest.num_buckets))
        return [b for b, i in enumerate(ids) if i is None or self._ids[b] != i]

    def commit(self, incoming: Incoming) -> None:
        """Hand the version's tensors to ``load_weights`` (one call); it holds the version once it returns."""
        manifest = incoming.manifest
        whole = self._layout != manifest.layout_hash or len(self._ids) != manifest.num_buckets
        if whole and len(incoming.buckets) != manifest.num_buckets:
            raise WeightMismatchError(f"{self.name}: a first version (or a new layout) must come whole")
        try:
            self.load_weights(incoming.tensors())
        except BaseException:
            self.forget()
            self._torn = True  # part of it may be in: what it holds is unknown
            raise
        if whole:
            self._layout, self._ids = manifest.layout_hash, [None] * manifest.num_buckets
        for b in incoming.buckets:
            self._ids[b] = incoming.ids[b]
        self._torn = False
        self.version = incoming.version

    def intact(self) -> bool:
        """False after a ``load_weights`` that raised, until a version goes in whole."""
        return not self._torn

    def forget(self) -> None:
        """Hold nothing known: the next version is handed over whole."""
        self._layout, self._ids, self.version = None, [], None


def _shape_dtype(name: Any, value: Any) -> tuple[tuple[int, ...], str]:
    """``(shape, dtype name)`` from a tensor or a ``(shape, dtype)`` pair."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), _dtype_name(value.dtype)
    try:
        shape, dtype = value
        return tuple(int(n) for n in shape), (
            _dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype).removeprefix("torch.")
        )
    except (TypeError, ValueError):
        raise TypeError(
            f"expected[{name!r}] must be a tensor or a (shape, dtype) pair, got {value!r}"
        ) from None
