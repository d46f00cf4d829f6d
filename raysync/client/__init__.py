"""What runs in the trainer's (or any caller's) process: the `HubClient`, finding or creating a
hub, the push pipeline, the writer's lease on version numbers, sharded ranks' parts and waits.

It talks to the hub only through the hub actor's typed methods; nothing in ``raysync.hub``
imports it."""
