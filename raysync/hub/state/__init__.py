"""What the hub knows and its rules, as plain Python (no Ray, no event loop needed).

Versions (stamped in order, the newest ``keep`` kept), writer leases (one writer per
model), subscribers (who holds what, who is behind), and waits (who a wait still
waits for). :class:`~raysync.hub.actor.WeightHub` is the shell around it that talks
to Ray: delivery loops, pings, persistence.

Example:
    >>> state = HubState("raysync", keep=2)
    >>> v = state.versions.stamp("policy", manifest, refs, pusher={"writer_id": "job:01"})
    >>> v.version, state.versions.latest("policy")
    (1, 1)
"""

from __future__ import annotations

from raysync.hub.state.laggards import Waits
from raysync.hub.state.layouts import Layouts
from raysync.hub.state.leases import Leases, lease_record, who
from raysync.hub.state.records import DeliveryGroup, Model, Subscriber, Tables, Version, Waiter
from raysync.hub.state.roster import Roster
from raysync.hub.state.versions import Versions

__all__ = ["DeliveryGroup", "HubState", "Model", "Subscriber", "Version", "Waiter", "lease_record", "who"]


class HubState:
    """The hub's rules over its models, subscribers and waits: five parts over one set of tables.

    Each part is a plain field: ``tables`` (what the hub knows, :class:`Tables`), ``leases``
    (who may write), ``layouts`` (what fits a model id), ``versions`` (numbers and kept
    versions), ``roster`` (subscribers) and ``waits`` (who a wait waits for, status). The
    hub calls each part's methods on the part (``state.versions.latest(model_id)``).
    """

    def __init__(self, name: str, keep: int, *, relay: bool = False) -> None:
        self.tables = Tables(name, max(1, int(keep)), relay)
        self.leases = Leases(self.tables)
        self.layouts = Layouts(self.tables)
        self.versions = Versions(self.tables, self.layouts)
        self.roster = Roster(self.tables, self.versions, self.layouts)
        self.waits = Waits(self.tables, self.layouts)
        # The tables' indexes (the same dicts, never replaced).
        self.models, self.subs, self.groups = self.tables.models, self.tables.subs, self.tables.groups
        self.waiters, self.subscribers = self.tables.waiters, self.tables.subscribers

    @property
    def name(self) -> str:
        return self.tables.name

    @property
    def keep(self) -> int:
        """Versions kept per model (raised by a client that asks for more, never lowered)."""
        return self.tables.keep

    @keep.setter
    def keep(self, keep: int) -> None:
        self.tables.keep = keep
