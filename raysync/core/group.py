"""Which group a sharded trainer's rank belongs to: one token every rank of the device mesh agrees on.

The hub must never merge the parts of two groups (two trainers pushing one model, or one
trainer before and after its process group was created again), and must check every rank's
part against the group's writer lease, which is held in the name of the group's rank 0. A
rank cannot tell by itself which group it is in, so the ranks ask each other once per
process group: group rank 0 (the mesh's first rank) makes a fresh random token and sends
it, with its own identity, to every rank of the mesh (:func:`identify_group`: one broadcast
of a small fixed-size byte tensor per mesh dimension, torch.distributed's public calls,
no pickle). Every part a rank pushes from then on names the token and rank 0's identity.

This is the one collective of a sharded push: the first push of each process group (and
the first after the group was created again) is made by every rank of the mesh, as every
SPMD step is; later pushes are not collective.

Example:
    >>> ident = identify_group(mesh, {"session": "ab12", "writer_id": "actor-1"})  # doctest: +SKIP
    >>> ident.token, ident.lead["writer_id"]                                       # doctest: +SKIP
    ('5f0c...', 'actor-1')
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from raysync.errors import InvalidWeightsError, SyncTimeoutError

__all__ = ["GroupIdentity", "identify_group", "parse_group"]

_PAYLOAD_BYTES = 1024  # 4 bytes of length, then JSON: a token and a writer's identity fit in far less
_LEAD_KEYS = ("session", "writer_id", "kind", "actor_id", "job_id", "pid", "host")


@dataclass(frozen=True)
class GroupIdentity:
    """What every rank of one process group knows of it.

    Attributes:
        token: a random hex string made by group rank 0 when the ranks first pushed over
            this process group; the hub matches parts of one push only within one token.
        lead: group rank 0's writer identity (the group's writer lease is in its name).
    """

    token: str
    lead: dict[str, Any]


def identify_group(mesh: Any, identity: dict[str, Any], *, timeout: float = 60.0) -> GroupIdentity:
    """The token and rank 0's identity of the group over ``mesh`` (a collective: every rank calls it).

    Group rank 0 (the rank at coordinate ``(0, ..., 0)``) makes the token and sends it with
    ``identity`` (its own writer identity) along each mesh dimension in turn, so that after
    the last one every rank holds rank 0's. Other ranks' ``identity`` is not sent.

    Raises:
        SyncTimeoutError: not every rank of the mesh took part within ``timeout`` seconds (a
            sharded push is collective the first time: every rank of the mesh calls it).
        InvalidWeightsError: what arrived is not a group identity (it is checked, never unpickled).
    """
    import torch.distributed as dist

    data = bytearray(_PAYLOAD_BYTES)
    coord = mesh.get_coordinate()
    if coord is None:
        raise InvalidWeightsError(f"this process is not in the device mesh {mesh} its weights are on")
    if all(c == 0 for c in coord):
        lead = {k: identity.get(k) for k in _LEAD_KEYS}
        raw = json.dumps({"token": uuid.uuid4().hex, "lead": lead}).encode()
        if len(raw) > _PAYLOAD_BYTES - 4:
            raise InvalidWeightsError(f"this rank's identity takes {len(raw)} bytes, more than a group's")
        data[:4] = len(raw).to_bytes(4, "little")
        data[4 : 4 + len(raw)] = raw
    payload = torch.frombuffer(data, dtype=torch.uint8)
    buf = payload.to(mesh.device_type) if mesh.device_type != "cpu" else payload
    deadline = time.monotonic() + timeout
    for dim in range(mesh.ndim):
        source = list(coord)
        source[dim] = 0
        src = int(mesh.mesh[tuple(source)].item())
        work = dist.broadcast(buf, src=src, group=mesh.get_group(dim), async_op=True)
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise SyncTimeoutError(
                    f"the first sharded push over this process group waited {timeout} s for every rank "
                    f"of mesh {tuple(mesh.shape)} to push too: each rank calls hub.push(model) alike"
                )
            time.sleep(0.001)
        work.wait()
    return parse_group(bytes(buf.cpu().numpy()))


def parse_group(raw: bytes) -> GroupIdentity:
    """The group identity in ``raw`` (what :func:`identify_group` sends), checked field by field.

    Raises:
        InvalidWeightsError: anything else.
    """
    size = int.from_bytes(raw[:4], "little")
    try:
        if not 0 < size <= len(raw) - 4:
            raise ValueError(f"length {size}")
        data = json.loads(raw[4 : 4 + size].decode())
        token, lead = data["token"], data["lead"]
        if not (isinstance(token, str) and len(token) == 32 and all(c in "0123456789abcdef" for c in token)):
            raise ValueError("token")
        if not isinstance(lead, dict) or set(lead) != set(_LEAD_KEYS):
            raise ValueError("lead")
        if not isinstance(lead["writer_id"], str) or not lead["writer_id"]:
            raise ValueError("writer_id")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise InvalidWeightsError(f"group rank 0 sent no group identity ({err})") from None
    return GroupIdentity(token, lead)
