"""``connect()``: the one call that finds (or creates) a hub and returns a :class:`HubClient`.

Example:
    >>> import ray, raysync, torch
    >>> ray.init()  # doctest: +SKIP
    >>> hub = raysync.connect()
    >>> v = hub.push(torch.nn.Linear(4, 2))
"""

from __future__ import annotations

import logging

from raysync._protocol import DEFAULT_HUB
from raysync.client.hub_client import HubClient
from raysync.client.locate import get_hub_actor
from raysync.hub.settings import HubSettings

__all__ = ["connect"]

logger = logging.getLogger(__name__)


def connect(
    name: str = DEFAULT_HUB,
    *,
    namespace: str | None = None,
    keep: int | None = None,
    takeover: bool = False,
    transport: str = "object_store",
    settings: HubSettings | None = None,
) -> HubClient:
    """Connect to the hub called ``name``, creating it if no one has.

    Args:
        name: the hub's actor name; one hub serves many models.
        namespace: Ray namespace of the hub; ``None`` is raysync's own
            (``"raysync"``), so every driver, job and the CLI share it.
        keep: how many versions per model the hub keeps at least (older ones are
            released). ``None`` leaves the hub's setting alone (2 for a new hub);
            a hub never lowers ``keep`` because one client asked for fewer than
            another (an evaluation job's ``connect()`` cannot drop versions a
            trainer keeps).
        takeover: push even to models another live trainer writes; that
            trainer's later pushes are then refused (``StaleWriterError``).
            Without it, a second writer gets ``StaleWriterError``. A writer
            is a process or an actor: every client it makes shares one lease.
        transport: the client's default data path, ``"object_store"`` or
            ``"nixl"`` (Ray's tensor transport; see :mod:`raysync.transports.nixl`).
        settings: how a hub created by this call delivers (relays, doorbells, priority;
            see :class:`~raysync.HubSettings`); fields left ``None`` come from the hub
            process's environment. A hub that exists already keeps the settings it was
            created with: a warning names the fields that differ.

    Returns:
        A picklable :class:`HubClient`: hand it to trainer actors or tasks.

    Example:
        >>> import ray, raysync, torch
        >>> ray.init()  # doctest: +SKIP
        >>> hub = raysync.connect()
        >>> v = hub.push(torch.nn.Linear(4, 2))
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"hub name must be a non-empty string, got {name!r}")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"keep must be None or an integer >= 1 (versions kept per model), got {keep!r}")
    if settings is not None and not isinstance(settings, HubSettings):
        raise TypeError(f"settings must be a raysync.HubSettings, got {type(settings).__name__}")
    client = HubClient(name, namespace=namespace, takeover=takeover, transport=transport)
    # a new hub: `keep` and `settings`
    client._handle = get_hub_actor(name, namespace, keep=keep, settings=settings, start_ray=True)
    client._calls.configure(keep)  # waits through a hub restart, as every call does
    if settings is not None:
        differs = settings.differs(client.settings())
        if differs:
            logger.warning(
                "hub %r was created with other settings and keeps them: %s (stop it, or connect "
                "to another hub name, to use yours)",
                name,
                ", ".join(f"{k}={theirs!r} (asked {mine!r})" for k, (mine, theirs) in differs.items()),
            )
    return client
