"""Weights as data, torch only (no Ray): layout and manifest, the bucket codec, bound modules.

``layout`` plans where each tensor goes, ``extract`` turns modules and state
dicts into flat tensors, ``codec`` packs and unpacks buckets (the one codec
every path uses), ``bound`` binds a module to a layout so a version is applied
with a few large copies, and ``readonly`` guards weights shared between actors.
"""
