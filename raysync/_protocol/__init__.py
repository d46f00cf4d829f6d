"""What the hub, its clients, subscribers, relays and adapters say to each other.

Every message is a frozen dataclass here; every method one side calls on the other is
named by a constant. Errors travel as exceptions (raysync's errors pickle across Ray),
never as strings to parse.

A subscriber need not be a Ray actor: one without a handle follows the hub by
long-poll (:data:`WAIT_NEWER`) or pull (:data:`GET`) and reports what it applied
(:data:`REPORT`). One :class:`Announcement` can carry many subscriptions
(``sub_ids``), so one call per node can serve every subscriber there.

Example:
    >>> report = ApplyReport(applied=3, apply_s=0.002)
    >>> report.holds(3), report.holds(4)
    (True, False)
"""

from raysync._protocol import messages, relay
from raysync._protocol.messages import *  # noqa: F403  (their __all__: the names listed once, there)
from raysync._protocol.relay import *  # noqa: F403

__all__ = [*messages.__all__, *relay.__all__]
