"""Bridges to other libraries, each imported only when used (``raysync.integrations.torchrl``)."""

__all__: list[str] = []
