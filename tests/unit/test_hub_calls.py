"""Every call a trainer or receiver makes to the hub matches the hub's own method (issue 43, item 4).

``HubCalls`` is the one place the hub's methods are called from outside the hub, each typed; this
checks each against the hub actor's method of the same name (``post_x`` sends ``x``), so that a hub
method whose parameters change without its callers fails here, not in a cluster.
"""

from __future__ import annotations

import inspect
from typing import Any

from raysync.client.hub_calls import HubCalls
from raysync.hub.actor import WeightHub

_DISPATCH = {"offer"}  # calls another method of HubCalls, not the hub


def _positional(fn: Any) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]
    return names[1:] if names[:1] == ["self"] else names  # the actor class's methods come bound


def mismatches(calls: type, hub: type) -> list[str]:
    """Where ``calls``' methods disagree with ``hub``'s: a method it lacks, or other parameters."""
    found = []
    for name, fn in inspect.getmembers(calls, inspect.isfunction):
        if name.startswith("_") or name in _DISPATCH:
            continue
        target = getattr(hub, name.removeprefix("post_"), None)
        if target is None:
            found.append(f"{name}: the hub has no {name.removeprefix('post_')}")
        elif _positional(fn) != _positional(target):
            found.append(f"{name}{_positional(fn)} != hub's {_positional(target)}")
    return found


def test_every_hub_call_matches_the_hub_method_it_calls() -> None:
    assert mismatches(HubCalls, WeightHub) == []
    assert len([n for n in dir(HubCalls) if not n.startswith("_")]) >= 20  # the calls all go through here


def test_the_check_finds_a_call_the_hub_does_not_take() -> None:
    class Drifted(HubCalls):
        def latest(self, model_id: str, version: int) -> int | None:  # type: ignore[override]
            return None

        def post_retire(self, model_id: str) -> Any:
            return None

    assert mismatches(Drifted, WeightHub) == [
        "latest['model_id', 'version'] != hub's ['model_id']",
        "post_retire: the hub has no retire",
    ]


def test_calls_send_the_hub_methods_name_and_arguments_and_posts_only_where_they_may() -> None:
    sent: list[tuple[Any, ...]] = []
    calls = HubCalls(lambda method, *args: sent.append((method, *args)) or 7)
    assert calls.latest("policy") == 7
    calls.wait("policy", 3, 1.5, True, False, 2)
    assert sent == [("latest", "policy"), ("wait", "policy", 3, 1.5, True, False, 2)]
    try:
        calls.post_heartbeat(["sub-1"])
    except TypeError as err:
        assert "cannot be posted" in str(err)
    else:
        raise AssertionError("a HubCalls without post posted")
