"""The hub's state is small parts held as plain fields over one set of tables (no chain of parents)."""

from __future__ import annotations

import torch

from raysync._protocol import Registration, SubscriberInfo
from raysync.core.layout import plan_layout
from raysync.hub.state import HubState
from raysync.hub.state.laggards import Waits
from raysync.hub.state.layouts import Layouts
from raysync.hub.state.leases import Leases
from raysync.hub.state.roster import Roster
from raysync.hub.state.versions import Versions

MANIFEST = plan_layout({"w": torch.zeros(4)})
TRAINER = {"writer_id": "job:01", "kind": "driver", "job_id": "01", "pid": 1, "host": "h"}


def test_each_part_is_a_field_of_its_own_class_not_a_parent() -> None:
    state = HubState("hub", 2)
    parts = {"leases": Leases, "layouts": Layouts, "versions": Versions, "roster": Roster, "waits": Waits}
    assert HubState.__mro__ == (HubState, object)
    for field, cls in parts.items():
        assert type(getattr(state, field)) is cls and cls.__mro__ == (cls, object), field
        assert getattr(state, field).tables is state.tables, field  # one set of tables, shared


def test_what_one_part_records_the_others_see() -> None:
    state = HubState("hub", 2)
    info = SubscriberInfo(mode="push", class_name="a")
    state.roster.register(Registration("a:policy", "policy", True, info))
    v = state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    laggards, failures = state.waits.pending("policy", v.version)
    assert [lag.subscriber for lag in laggards] == ["a:policy"] and failures == []
    state.keep = 5  # what the hub raises for a client is what the versions part keeps
    assert state.tables.keep == 5 and state.waits.status()["keep"] == 5
