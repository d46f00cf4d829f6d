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
    >>> report.holds(3), report.settles(3)
    (True, True)
"""

from raysync._protocol.messages import (
    ACQUIRE,
    ANSWER,
    BLOCK,
    CONTRIBUTE,
    DEFAULT_HUB,
    DEFAULT_KEEP,
    DEFAULT_NAMESPACE,
    GET,
    GIVE_UP,
    HEARTBEAT,
    HEARTBEAT_S,
    NOTIFY,
    PING,
    POLL,
    PUBLISH,
    PUBLISH_STAMPED,
    REGISTER,
    RELAY_ACKS,
    RELAY_DELIVER,
    REPORT,
    UNREGISTER,
    WAIT_NEWER,
    Announcement,
    Answer,
    ApplyReport,
    Caller,
    Grant,
    Laggard,
    PollReply,
    Publication,
    Registration,
    Request,
    SubscriberInfo,
    WaitResult,
    address_job,
    bucket_ids,
    process_address,
)
from raysync._protocol.relay import (
    RelayAck,
    RelayDelivery,
    RelayMember,
    RelayReply,
    Ring,
    compact,
    expand,
)

__all__ = [
    "ACQUIRE",
    "ANSWER",
    "BLOCK",
    "CONTRIBUTE",
    "DEFAULT_HUB",
    "DEFAULT_KEEP",
    "DEFAULT_NAMESPACE",
    "GIVE_UP",
    "GET",
    "HEARTBEAT",
    "HEARTBEAT_S",
    "NOTIFY",
    "PING",
    "POLL",
    "PUBLISH",
    "PUBLISH_STAMPED",
    "REGISTER",
    "RELAY_ACKS",
    "RELAY_DELIVER",
    "REPORT",
    "UNREGISTER",
    "WAIT_NEWER",
    "Announcement",
    "Answer",
    "ApplyReport",
    "Caller",
    "Grant",
    "Laggard",
    "PollReply",
    "Publication",
    "Registration",
    "RelayAck",
    "RelayDelivery",
    "RelayMember",
    "RelayReply",
    "Request",
    "Ring",
    "SubscriberInfo",
    "WaitResult",
    "address_job",
    "bucket_ids",
    "process_address",
    "compact",
    "expand",
]
