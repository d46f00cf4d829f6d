"""A version in a sealed anonymous shared-memory file: written once by the relay, read by the rung.

``memfd_create``, one gathered write, then ``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW``:
from then on the kernel refuses every write to it, by anyone, its writer included. It
has no name: it reaches a subscriber process only as a descriptor sent along with a MAC'd
ring, and is freed when the last process holding it lets go.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysync._protocol import Ring
from raysync.transports.doorbell import wire

__all__ = ["Segment", "SegmentHandle", "SegmentWriter", "read_segment"]

_ALIGN = 64
_IOV_MAX = 512  # buffers per pwritev (the system's limit is 1024)
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass
class Segment:
    """A version as a subscriber reads it from its sealed segment.

    Attributes:
        model_id: the model.
        version: the version.
        manifest: its :class:`~raysync.core.layout.Manifest`.
        ids: each bucket's identity (the hex of the object it came from).
        buckets: each bucket's tensors, as read-only uint8 arrays over the mapping.
    """

    model_id: str
    version: int
    manifest: Any
    ids: list[str | None]
    buckets: list[list[np.ndarray]]


@dataclass
class SegmentHandle:
    """A written, sealed segment: its descriptor (rung along with each ring) and identity."""

    fd: int
    size: int
    inode: int
    device: int

    def close(self) -> None:
        """Let go of it: it is freed once every process rung with it did too."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class SegmentWriter:
    """A relay's segments: one sealed anonymous file per version rung.

    Example:
        >>> segment = SegmentWriter().write("policy", 3, manifest, ids, arrays)
        >>> segment.close()   # once every process was rung with it
    """

    def write(
        self,
        model_id: str,
        version: int,
        manifest: Any,
        ids: Sequence[str | None],
        buckets: Sequence[Sequence[np.ndarray]],
    ) -> SegmentHandle:
        """Write a version (each bucket: its tensors' uint8 arrays) into a new sealed segment.

        Raises:
            OSError: no memory for it (the caller falls back to actor calls).
            ValueError: a version the wire format does not carry (extra state).
        """
        sizes = [[int(a.nbytes) for a in arrays] for arrays in buckets]
        header = wire.encode_segment_header(model_id, version, manifest, ids, sizes)
        # One gathered write (pwritev) of header, buckets and the padding between them.
        parts: list[Any] = [header]
        end = len(header)
        for arrays in buckets:
            for a in arrays:
                pad = _aligned(end) - end
                if pad:
                    parts.append(bytes(pad))
                n = int(a.nbytes)
                if n:
                    parts.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
                end += pad + n
        fd = os.memfd_create(f"raysync-v{version}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            offset = 0
            for i in range(0, len(parts), _IOV_MAX):
                chunk = parts[i : i + _IOV_MAX]
                want = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in chunk)
                if os.pwritev(fd, chunk, offset) != want:
                    raise OSError(errno.ENOSPC, "short write to a segment")
                offset += want
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # no one writes it again, not even us
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return SegmentHandle(fd, st.st_size, st.st_ino, st.st_dev)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def read_segment(fd: int, ring: Ring) -> Segment:
    """Map the segment a ring came with, read-only, after checking it is the one the ring names.

    The descriptor must be a regular file of this user, sealed against writes,
    of the ring's size, inode and device; its header must name the ring's model and
    version, and its arrays fit in it.

    Raises:
        ValueError: it is not (the ring is dropped).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise ValueError("not a regular file of this user")
    if (st.st_size, st.st_ino, st.st_dev) != (ring.segment_size, ring.segment_inode, ring.segment_device):
        raise ValueError("not the segment the ring names")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as err:
        raise ValueError(f"not a sealed segment ({err})") from err
    if seals & _SEALS != _SEALS:
        raise ValueError("segment not sealed against writes")
    if st.st_size == 0:
        raise ValueError("empty segment")
    mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
    try:
        model_id, version, manifest, ids, sizes, end = wire.decode_segment_header(memoryview(mm), st.st_size)
        if (model_id, version) != (ring.model_id, ring.version):
            raise ValueError("segment holds another version than the ring names")
        buckets: list[list[np.ndarray]] = []
        for bucket in sizes:
            arrays = []
            for n in bucket:
                end = _aligned(end)
                if end + n > st.st_size:
                    raise ValueError("segment arrays run past its end")
                arrays.append(np.frombuffer(mm, dtype=np.uint8, count=n, offset=end))
                end += n
            buckets.append(arrays)
    except BaseException:
        with contextlib.suppress(BufferError):
            mm.close()
        raise
    return Segment(model_id, version, manifest, ids, buckets)
