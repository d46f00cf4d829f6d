"""LoRA adapters as models of their own: what a trainer pushes, and what a receiver checks first.

An adapter version is a flat dict in PEFT's saved layout (the names
``peft.get_peft_model_state_dict`` gives and vLLM reads:
``base_model.model.<module>.lora_A.weight`` of shape ``(r, in)`` and
``...lora_B.weight`` of shape ``(out, r)``) and its config (rank, alpha, target
modules), which travels as the version's extra state (``"_extra_state"``, in the
manifest, so a receiver reads it before any byte is fetched). :func:`lora_adapter`
builds it from a PEFT model or from such tensors; :func:`adapter_config` reads and
checks it on the receiving side.

Example:
    >>> a = torch.zeros(4, 16); b = torch.zeros(32, 4)
    >>> w = lora_adapter({"base_model.model.layers.0.q_proj.lora_A.weight": a,
    ...                   "base_model.model.layers.0.q_proj.lora_B.weight": b}, alpha=8)
    >>> w["_extra_state"]
    {'r': 4, 'lora_alpha': 8.0, 'target_modules': ['q_proj'], 'use_rslora': False}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from raysync.core.layout import _EXTRA, Manifest
from raysync.errors import RaySyncError

__all__ = [
    "PREFIX",
    "AdapterConfig",
    "adapter_config",
    "lora_adapter",
    "lora_module",
    "peft_views",
    "unpaired",
]

PREFIX = "base_model.model."
"""What every tensor name of an adapter version starts with (PEFT's saved layout)."""
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """An adapter's config, as its versions carry it.

    Attributes:
        r: the rank (rows of each ``lora_A``, columns of each ``lora_B``).
        lora_alpha: the scale's numerator: the update is ``(lora_alpha / r) * B @ A``
            (``lora_alpha / sqrt(r)`` with ``use_rslora``).
        target_modules: the last names of the modules it adapts (``"q_proj"``).
        use_rslora: rank-stabilised scaling.
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def as_peft(self) -> dict[str, Any]:
        """The config as PEFT's ``adapter_config.json`` fields (what vLLM's ``PEFTHelper`` reads)."""
        return {
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "bias": "none",
            "peft_type": "LORA",
        }


def lora_module(name: str) -> tuple[str, str] | None:
    """``(module path, "A" or "B")`` of an adapter tensor's name, or None if it is not one.

    Example:
        >>> lora_module("base_model.model.layers.0.q_proj.lora_B.weight")
        ('layers.0.q_proj', 'B')
    """
    if not name.startswith(PREFIX):
        return None
    for suffix, which in ((_A, "A"), (_B, "B")):
        if name.endswith(suffix) and len(name) > len(PREFIX) + len(suffix):
            return name[len(PREFIX) : -len(suffix)], which
    return None


def unpaired(names: Iterable[str]) -> list[str]:
    """The modules among adapter tensor ``names`` that have ``lora_A`` or ``lora_B`` alone, sorted.

    Example:
        >>> unpaired(["base_model.model.q.lora_A.weight", "base_model.model.q.lora_B.weight",
        ...           "base_model.model.v.lora_A.weight"])
        ['v']
    """
    sides: dict[str, set[str]] = {}
    for name in names:
        found = lora_module(name)
        if found is not None:
            sides.setdefault(found[0], set()).add(found[1])
    return sorted(m for m, s in sides.items() if s != {"A", "B"})


def lora_adapter(
    weights: Any, *, alpha: float | None = None, adapter_name: str = "default"
) -> dict[str, Any]:
    """An adapter version to push: its tensors in PEFT's saved layout, and its config.

    Push it as a model of its own (``hub.push(lora_adapter(peft_model), "math")``): only
    the adapter's bytes move, with versions, writer and ``keep`` of their own; a vLLM engine
    following it (``follow_engine(llm, "policy", adapters=["math"])``) serves it.

    Args:
        weights: a PEFT model (its adapter ``adapter_name``: tensors and config), or
            ``{name: tensor}`` in PEFT's saved layout (``base_model.model.<module>.lora_A.weight``
            and ``...lora_B.weight``), with ``alpha``.
        alpha: ``lora_alpha`` for a dict (a PEFT model's config has its own).
        adapter_name: which of a PEFT model's adapters.

    Raises:
        RaySyncError: a tensor named otherwise, a module with ``lora_A`` and no ``lora_B``
            (or the other way), ranks that differ, no ``alpha`` for a dict, an adapter
            the PEFT model lacks, or PEFT features beyond plain LoRA (DoRA, biases,
            per-module ranks).

    Example:
        >>> hub.push(raysync.lora_adapter(peft_model), "math")  # doctest: +SKIP
        1
    """
    peft_config = getattr(weights, "peft_config", None)
    if isinstance(peft_config, Mapping):
        tensors, alpha, rslora = _from_peft(weights, peft_config, adapter_name)
    else:
        if not isinstance(weights, Mapping):
            raise RaySyncError(
                f"lora_adapter takes a PEFT model or a {{name: tensor}} dict, not {type(weights).__name__}"
            )
        if alpha is None:
            raise RaySyncError("lora_adapter: give the adapter's alpha (lora_alpha) with a dict of tensors")
        tensors, rslora = dict(weights), False
    config = _config_of(tensors, float(alpha), rslora)
    return {**tensors, _EXTRA: dataclasses.asdict(config) | {"target_modules": list(config.target_modules)}}


def _from_peft(
    model: Any, peft_config: Mapping[str, Any], adapter: str
) -> tuple[dict[str, torch.Tensor], float, bool]:
    if adapter not in peft_config:
        raise RaySyncError(
            f"lora_adapter: the PEFT model has no adapter {adapter!r} (it has {sorted(peft_config)})"
        )
    cfg = peft_config[adapter]
    beyond = [
        what
        for what, used in (
            ("use_dora", getattr(cfg, "use_dora", False)),
            ("bias", getattr(cfg, "bias", "none") != "none"),
            ("rank_pattern", bool(getattr(cfg, "rank_pattern", None))),
            ("alpha_pattern", bool(getattr(cfg, "alpha_pattern", None))),
            ("modules_to_save", bool(getattr(cfg, "modules_to_save", None))),
        )
        if used
    ]
    if beyond:
        raise RaySyncError(
            f"lora_adapter: adapter {adapter!r} uses {beyond}; raysync moves plain LoRA adapters"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        for which in ("lora_A", "lora_B"):
            own = f".{which}.{adapter}.weight"
            if name.endswith(own):
                path = name[: -len(own)]
                tensors[path + f".{which}.weight"] = param.detach()
    if not tensors:
        raise RaySyncError(f"lora_adapter: the PEFT model has no LoRA weights for adapter {adapter!r}")
    return tensors, float(cfg.lora_alpha), bool(getattr(cfg, "use_rslora", False))


def _config_of(tensors: Mapping[str, Any], alpha: float, rslora: bool) -> AdapterConfig:
    """The config of an adapter's tensors; every name and rank checked."""
    modules: set[str] = set()
    ranks: set[int] = set()
    for name, t in tensors.items():
        found = lora_module(name)
        if found is None or not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise RaySyncError(
                f"lora_adapter: {name!r} is not a LoRA tensor (2-D, named "
                f"'{PREFIX}<module>{_A}' or '...{_B}')"
            )
        module, which = found
        modules.add(module)
        ranks.add(int(t.shape[0] if which == "A" else t.shape[1]))
    halves = unpaired(tensors)
    if halves:
        raise RaySyncError(f"lora_adapter: modules with lora_A or lora_B alone: {halves[:5]}")
    if not modules:
        raise RaySyncError("lora_adapter: no tensors")
    if len(ranks) != 1:
        raise RaySyncError(f"lora_adapter: the modules' ranks differ ({sorted(ranks)}); one rank per adapter")
    targets = tuple(sorted({m.rpartition(".")[2] for m in modules}))
    return _checked(AdapterConfig(ranks.pop(), alpha, targets, rslora))


def _checked(config: AdapterConfig) -> AdapterConfig:
    if config.r < 1 or not math.isfinite(config.lora_alpha) or not config.target_modules:
        raise RaySyncError(
            f"an adapter's config needs r >= 1, a finite lora_alpha and target modules: {config}"
        )
    return config


def adapter_config(manifest: Manifest) -> AdapterConfig:
    """The config an adapter version carries (its extra state), every field checked.

    Raises:
        RaySyncError: the version carries none (not pushed through :func:`lora_adapter`),
            or a field of the wrong type.
    """
    raw = manifest.extra_states().get(_EXTRA)
    if not isinstance(raw, Mapping):
        raise RaySyncError(
            "this version is no LoRA adapter: it carries no adapter config "
            "(push adapters as hub.push(raysync.lora_adapter(...), adapter_id))"
        )
    try:
        r, alpha, targets = raw["r"], raw["lora_alpha"], raw["target_modules"]
        rslora = raw.get("use_rslora", False)
        if (
            not isinstance(r, int)
            or isinstance(r, bool)
            or not isinstance(alpha, (int, float))
            or not isinstance(targets, (list, tuple))
            or not all(isinstance(t, str) and t for t in targets)
            or not isinstance(rslora, bool)
        ):
            raise TypeError
    except (KeyError, TypeError):
        raise RaySyncError(f"an adapter version's config is malformed: {dict(raw)!r:.300}") from None
    return _checked(AdapterConfig(r, float(alpha), tuple(targets), rslora))


def peft_views(model: Any, adapter_name: str = "default") -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two modules over a PEFT model's own tensors: its base weights under the names a
    ``transformers`` state dict has, and its adapter under the names :func:`lora_adapter` pushes.

    What an actor with a PEFT model syncs: one ``@synced_model`` per view, the base from the
    base model's id and the adapter from the adapter's. A version applied to a view is
    written into the PEFT model's own parameters (the views hold the same tensors, no copy),
    between the actor's method calls, whole or not at all, as for any module.

    Raises:
        RaySyncError: no adapter ``adapter_name``, or no LoRA weights for it.

    Example:
        >>> @ray.remote
        ... @raysync.synced_model("base", model_id="policy")
        ... @raysync.synced_model("adapter", model_id="math")
        ... class Rollout:
        ...     def __init__(self):
        ...         self.policy = peft.get_peft_model(make_llama(), lora_config)
        ...         self.base, self.adapter = raysync.peft_views(self.policy)   # doctest: +SKIP
    """
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, Mapping) or adapter_name not in peft_config:
        raise RaySyncError(f"peft_views: not a PEFT model with an adapter {adapter_name!r}")
    own = f".{adapter_name}."
    base: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if ".lora_A." in name or ".lora_B." in name:
            if own in name:
                adapter[name.replace(own, ".")] = tensor
        elif name.startswith(PREFIX) and ".lora_" not in name:
            base[name[len(PREFIX) :].replace(".base_layer.", ".")] = tensor
    if not adapter:
        raise RaySyncError(f"peft_views: the PEFT model has no LoRA weights for adapter {adapter_name!r}")
    return _view(base, torch.nn.Module()), _view(adapter, _AdapterView())


class _AdapterView(torch.nn.Module):
    """The root of an adapter's view: it takes the config each adapter version carries
    (its extra state), so that the version applies as a module's does."""

    def __init__(self) -> None:
        super().__init__()
        self.config: dict[str, Any] = {}

    def get_extra_state(self) -> dict[str, Any]:
        return dict(self.config)

    def set_extra_state(self, state: Any) -> None:
        self.config = dict(state) if isinstance(state, Mapping) else {}


def _view(tensors: Mapping[str, torch.Tensor], root: torch.nn.Module) -> torch.nn.Module:
    """``root`` with ``tensors`` as its state dict, the same tensor objects (parameters stay parameters)."""
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        if isinstance(tensor, torch.nn.Parameter):
            module.register_parameter(leaf, tensor)
        else:
            module.register_buffer(leaf, tensor)
    return root
