"""The hub and relay processes, nothing else: what the hub knows (``state``), the actor
(``actor``), how versions are handed out (``delivery``, ``relay``, ``mailbox``) and what
outlives a restart (``persistence``). It imports no torch and nothing of ``raysync.client``."""
