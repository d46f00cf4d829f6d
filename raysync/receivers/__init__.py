"""Receivers: ``@synced_model`` actors and ``RayModuleTransform``, their subscriptions and locks."""
