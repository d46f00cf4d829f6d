"""The exceptions raysync raises.

Every error derives from :class:`RaySyncError` and from the built-in exception
a caller would already catch for that kind of failure::

    RaySyncError
    ├── SyncTimeoutError        (TimeoutError)   a wait ran out; names the laggards
    ├── WeightMismatchError     (ValueError)     keys / shapes / dtypes do not match the model
    ├── InvalidWeightsError     (TypeError)      not weights at all: empty, non-tensor leaves
    ├── UnknownModelError       (KeyError)       no version was ever pushed for that model_id
    ├── AmbiguousModelError     (ValueError)     which model? the actor syncs several; pass model_id
    ├── ChecksumError           (ValueError)     a bucket's bytes do not match its checksum
    ├── ApplyError              (RuntimeError)   a subscriber failed to apply a version
    ├── StaleWriterError        (PermissionError) another live process holds the model's writer lease
    ├── ReadOnlyWeightsError    (RuntimeError)   an in-place write to ``apply="view"`` weights
    └── RayNotRunningError      (RuntimeError)   a hub call after ``ray.shutdown()`` (or before Ray started)

Example:
    >>> import raysync
    >>> issubclass(raysync.SyncTimeoutError, TimeoutError)
    True
"""

from __future__ import annotations

from typing import Any


class RaySyncError(Exception):
    """Base class of every raysync error.

    Errors keep their message when they cross a Ray boundary (they pickle by
    their arguments), so ``except raysync.RaySyncError`` works around
    ``ray.get`` too.

    Example:
        >>> try:
        ...     raise raysync.SyncTimeoutError("no")
        ... except raysync.RaySyncError as e:
        ...     print(type(e).__name__)
        SyncTimeoutError
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args, self.__dict__)


class SyncTimeoutError(RaySyncError, TimeoutError):
    """A wait for subscribers ran past its timeout.

    Attributes:
        laggards: one dict per subscriber that had not applied the version
            (``subscriber``, ``actor``, ``applied``, ``error``).

    Example:
        >>> hub.wait(v, timeout=5)  # doctest: +SKIP
        raysync.SyncTimeoutError: 1 of 4 subscribers of 'policy' did not apply version 7 ...
    """

    def __init__(self, message: str, laggards: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.laggards = list(laggards or [])


class WeightMismatchError(RaySyncError, ValueError):
    """Weights do not fit a model: every problem is listed at once.

    Attributes:
        missing: keys the model has and the weights lack.
        unexpected: keys the weights have and the model lacks.
        shape_mismatch: ``{key: (weights_shape, model_shape)}``.
        dtype_mismatch: ``{key: (weights_dtype, model_dtype)}``.

    Example:
        >>> hub.push({"w": torch.zeros(3)})  # doctest: +SKIP
        raysync.WeightMismatchError: weights do not match the model: missing keys ['b'] ...
    """

    def __init__(
        self,
        message: str,
        *,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        shape_mismatch: dict[str, tuple[Any, Any]] | None = None,
        dtype_mismatch: dict[str, tuple[Any, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.shape_mismatch = dict(shape_mismatch or {})
        self.dtype_mismatch = dict(dtype_mismatch or {})


class InvalidWeightsError(RaySyncError, TypeError):
    """What was given is not a set of weights raysync can carry.

    Example:
        >>> raysync.core.extract.extract_tensors({})  # doctest: +SKIP
        raysync.InvalidWeightsError: no tensors to push: the weights are empty ...
    """


class UnknownModelError(RaySyncError, KeyError):
    """No version of this ``model_id`` exists on the hub.

    Example:
        >>> hub.pull("nope")  # doctest: +SKIP
        raysync.UnknownModelError: no version of model 'nope' on hub 'raysync' ...
    """

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


class AmbiguousModelError(RaySyncError, ValueError):
    """A call that names no ``model_id`` on an actor that syncs several models.

    Attributes:
        models: the model ids the actor syncs.

    Example:
        >>> self.raysync_version()  # doctest: +SKIP
        raysync.AmbiguousModelError: ActorCritic syncs 2 models (['actor', 'critic']): say which,
        e.g. self.raysync_version(model_id='actor')
    """

    def __init__(self, message: str, models: list[str] | None = None) -> None:
        super().__init__(message)
        self.models = list(models or [])


class ChecksumError(RaySyncError, ValueError):
    """A received bucket's bytes do not match the checksum taken at push time.

    Also raised to a ``verify=True`` subscriber for a version that carries no
    checksums (pushed with ``checksum=False``, or over NIXL): it is refused.

    Example:
        >>> hub.push(model, checksum=True)  # doctest: +SKIP
    """


class ApplyError(RaySyncError, RuntimeError):
    """One or more subscribers failed to apply a version (their previous one stays).

    Attributes:
        failures: one dict per failed subscriber (``subscriber``, ``error``).

    Example:
        >>> hub.wait(v)  # doctest: +SKIP
        raysync.ApplyError: 1 subscriber of 'policy' failed to apply version 3 ...
    """

    def __init__(self, message: str, failures: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.failures = list(failures or [])


class StaleWriterError(RaySyncError, PermissionError):
    """Another live trainer holds the writer lease of this model; pushes from here are refused.

    One writer per ``model_id``: the first process (or actor) that pushes
    holds the lease until it dies or another takes over with
    ``raysync.connect(..., takeover=True)``.

    Example:
        >>> hub.push(model)  # doctest: +SKIP
        raysync.StaleWriterError: model 'policy' is written by actor 1f2e... (pid 4242) ...
    """


class ReadOnlyWeightsError(RaySyncError, RuntimeError):
    """An in-place write to weights that are shared read-only views (``apply="view"``), or a
    backward pass through them (they take no gradients: training needs ``apply="copy"``).

    Example:
        >>> self.policy.weight.add_(1)  # doctest: +SKIP
        raysync.ReadOnlyWeightsError: 'add_' would write into weights shared ...
    """


class RayNotRunningError(RaySyncError, RuntimeError):
    """A hub call in a process where Ray is not running (``ray.shutdown()`` was called, or
    Ray never started here).

    Only :func:`raysync.connect` starts Ray (as Ray's own API does on first use); a client's
    ``push``, ``wait``, ``pull`` and queries never start a cluster of their own.

    Example:
        >>> ray.shutdown(); hub.push(model)  # doctest: +SKIP
        raysync.RayNotRunningError: Ray is not running in this process ...
    """


class EngineNotReadyError(RaySyncError, RuntimeError):
    """An inference engine asked to generate while it holds no whole version: none yet (it
    (re)started and the hub's newest has not gone in) or a failed update tore it.

    Example:
        >>> engine.generate(prompts, params)  # doctest: +SKIP
        raysync.EngineNotReadyError: vLLM engine holds no whole version yet
    """
