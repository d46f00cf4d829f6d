"""The node-local hop from a relay to its node's subscriber processes: a sealed segment and a doorbell.

A relay hands a version to the subscribers on its node. Made as one Ray actor call
per subscriber, that hop costs about a millisecond of CPU each. For versions of up
to the hub's ``doorbell_bytes`` (:class:`~raysync.hub.settings.HubSettings`, 8 MiB by
default) a relay instead

1. writes the version once into a *sealed* anonymous shared-memory file
   (:class:`SegmentWriter`: ``memfd_create``, then ``F_SEAL_WRITE | F_SEAL_SHRINK |
   F_SEAL_GROW``: from then on the kernel refuses every write, by anyone),
2. rings each subscriber process's doorbell (:class:`Ringer`): one datagram to the
   process's Unix socket carrying a MAC'd ring (:mod:`.wire`) and the
   segment's file descriptor (``SCM_RIGHTS``),
3. collects the acks, one MAC'd datagram per process (:class:`Ringer.wait`).

In each subscriber process one daemon thread (:class:`Doorbell`) waits on its
socket, checks every datagram (sender's uid, size, MAC, the segment it carries),
maps the segment read-only and hands it to each subscription named, which copies
what changed into its model under the actor's write lock, and answers. Anything
else is dropped, counted, and logged at most once per :data:`LOG_EVERY_S`.

Why no one else can ring or forge (docs/security.md): the sockets live in a
directory only the Ray session's user can enter (mode 0700, checked); the
doorbell's key (:data:`~raysync.transports.doorbell.wire.KEY_BYTES` random bytes)
reaches the hub and the relay only through Ray's authenticated calls, so a ring
whose MAC checks was made by one of them; the segment comes as a file descriptor
(no name to guess, open, race or replace) and is sealed, so its bytes are the
ones the relay wrote; it disappears when the last process holding it lets go.

``HubSettings(doorbell_bytes=...)`` (or ``RAYSYNC_DOORBELL_BYTES`` in the hub's
environment) sets the size limit (``0`` turns the doorbell off); ``RAYSYNC_RUNTIME_DIR``
the sockets' directory.

Example:
    >>> bell = doorbell()                                   # a subscriber process
    >>> bell.register("a1:policy", lambda ring, segment: ApplyReport(applied=ring.version))
    >>> ringer = Ringer()                                   # the relay of its node
    >>> segment = SegmentWriter().write("policy", 3, manifest, ids, arrays)
    >>> tokens = ringer.ring(bell.address, bell.key, "policy", 3, segment, ("a1:policy",))
    >>> acks, missing = await ringer.wait(tokens, timeout=0.2)
"""

from raysync.transports.doorbell.bell import Doorbell, Handler, doorbell
from raysync.transports.doorbell.ringer import CONNECTIONS_QUEUED_FULL, Ringer
from raysync.transports.doorbell.segments import Segment, SegmentHandle, SegmentWriter, read_segment
from raysync.transports.doorbell.sockets import LOG_EVERY_S, available, runtime_dir

__all__ = [
    "CONNECTIONS_QUEUED_FULL",
    "LOG_EVERY_S",
    "Doorbell",
    "Handler",
    "Ringer",
    "Segment",
    "SegmentHandle",
    "SegmentWriter",
    "available",
    "doorbell",
    "read_segment",
    "runtime_dir",
]
