"""What the hub knows and its rules, as plain Python (no Ray, no event loop needed).

Versions (stamped in order, the newest ``keep`` kept), writer leases (one writer per
model), subscribers (who holds what, who is behind), and waits (who a wait still
waits for). :class:`~raysync.hub.actor.WeightHub` is the shell around it that talks
to Ray: delivery loops, pings, persistence.

Example:
    >>> state = HubState("raysync", keep=2)
    >>> v = state.stamp("policy", manifest, refs, pusher={"writer_id": "job:01"})
    >>> v.version, state.latest("policy")
    (1, 1)
"""

from __future__ import annotations

from typing import Any

from raysync.hub.state.laggards import Waits
from raysync.hub.state.leases import lease_record, who
from raysync.hub.state.records import Group, Model, Subscriber, Version, Waiter

__all__ = ["Group", "HubState", "Model", "Subscriber", "Version", "Waiter", "lease_record", "who"]


class HubState(Waits):
    """The hub's rules over its models, subscribers and waits.

    Indexes keep every event O(1) in the number of subscribers of other models:
    by model, by batch group, and the waits of each model.
    """

    def __init__(self, name: str, keep: int, *, relay: bool = False) -> None:
        self.name = name
        self.keep = max(1, int(keep))
        self.relay = relay  # deliver push subscriptions through one relay per node
        self.delivery_calls = 0  # Ray calls the hub made to hand out versions (relays and subscribers)
        self.models: dict[str, Model] = {}
        self.subs: dict[str, Subscriber] = {}
        self.by_model: dict[str, dict[str, Subscriber]] = {}
        self.groups: dict[str, Group] = {}
        self.waiters: dict[str, set[Waiter]] = {}
        self.round_blocks: dict[str, tuple[int, int]] = {}  # numbers reserved for sharded rounds
        self._fits: set[tuple[str, Any]] = set()  # (layout hash, schema key) found to fit
        self._misfits: dict[tuple[str, Any], str] = {}  # (layout hash, schema key) -> why it does not
