"""The hub: what it knows (``state``), the actor (``actor``), what users hold (``client``),
how a version is pushed (``push``) and what outlives a restart (``persistence``)."""
