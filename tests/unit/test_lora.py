"""LoRA adapter versions: what a trainer pushes (``raysync.lora_adapter``) and what an engine's
adapter target refuses before any byte is fetched (from the manifest alone). No vLLM needed:
the engine is a stand-in holding what :class:`VLLMAdapter` reads (its schema, LoRA limits)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import raysync
from raysync.core.layout import plan_layout
from raysync.core.lora import adapter_config
from raysync.engines.vllm_lora import WORKER_EXTENSION, AdapterWorker, VLLMAdapter, adapter_targets

P = "base_model.model."


def _adapter(
    rank: int = 4, modules: tuple[str, ...] = ("layers.0.q_proj", "layers.1.q_proj")
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in modules:
        out[f"{P}{m}.lora_A.weight"] = torch.randn(rank, 16)
        out[f"{P}{m}.lora_B.weight"] = torch.randn(32, rank)
    return out


def _manifest(weights: dict[str, Any]) -> Any:
    tensors = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
    extra = {k: v for k, v in weights.items() if not isinstance(v, torch.Tensor)}
    return plan_layout(tensors).with_extra_state(extra)


def _engine(
    max_rank: int = 8, max_loras: int = 2, lora: bool = True, extension: str = WORKER_EXTENSION
) -> Any:
    config = (
        SimpleNamespace(max_lora_rank=max_rank, max_loras=max_loras, max_cpu_loras=None) if lora else None
    )
    schema = {f"layers.{i}.q_proj.weight": (32, 16) for i in range(2)} | {"norm.weight": (16,)}
    return SimpleNamespace(
        llm=SimpleNamespace(
            vllm_config=SimpleNamespace(
                lora_config=config, parallel_config=SimpleNamespace(worker_extension_cls=extension)
            )
        ),
        name="engine",
        _schema=schema,
        _adapters={},
        adapter_followers=[],
    )


def test_an_adapter_version_carries_its_config_beside_its_tensors() -> None:
    weights = raysync.lora_adapter(_adapter(), alpha=8)
    assert weights["_extra_state"] == {
        "r": 4,
        "lora_alpha": 8.0,
        "target_modules": ["q_proj"],
        "use_rslora": False,
    }
    config = adapter_config(_manifest(weights))
    assert (config.r, config.lora_alpha, config.target_modules) == (4, 8.0, ("q_proj",))
    assert config.as_peft()["peft_type"] == "LORA"


@pytest.mark.parametrize(
    ("weights", "alpha", "why"),
    [
        ({"layers.0.q_proj.weight": torch.zeros(2, 2)}, 8, "is not a LoRA tensor"),
        ({f"{P}layers.0.q_proj.lora_A.weight": torch.zeros(4, 16)}, 8, "lora_A or lora_B alone"),
        ({**_adapter(4, ("a.q",)), **_adapter(2, ("b.q",))}, 8, "ranks differ"),
        (_adapter(), None, "give the adapter's alpha"),
        ([torch.zeros(2)], 8, "takes a PEFT model or a"),
        ({}, 8, "no tensors"),
    ],
    ids=["name", "half", "ranks", "alpha", "type", "empty"],
)
def test_what_is_no_plain_lora_adapter_is_refused_at_the_push_naming_why(
    weights: Any, alpha: Any, why: str
) -> None:
    with pytest.raises(raysync.RaySyncError, match=why):
        raysync.lora_adapter(weights, alpha=alpha)


def test_an_engine_adapter_takes_a_version_that_fits() -> None:
    target = VLLMAdapter(_engine(), "math")  # type: ignore[arg-type]
    manifest = _manifest(raysync.lora_adapter(_adapter(), alpha=8))
    target.check(manifest)
    assert target.needed(manifest, [None] * manifest.num_buckets) == list(range(manifest.num_buckets))


@pytest.mark.parametrize(
    ("weights", "why"),
    [
        (raysync.lora_adapter(_adapter(rank=16), alpha=8), "rank 16 exceeds the engine's max_lora_rank 8"),
        (
            raysync.lora_adapter(_adapter(modules=("layers.0.k_proj",)), alpha=8),
            r"no modules named \['k_proj'\]",
        ),
        (
            {
                **raysync.lora_adapter(_adapter(), alpha=8),
                f"{P}layers.0.q_proj.lora_A.weight": torch.zeros(4, 15),
            },
            r"shape mismatch base_model\.model\.layers\.0\.q_proj\.lora_A\.weight",
        ),
        (_adapter(), "carries no adapter config"),
        (
            {**_adapter(), "_extra_state": {"r": "4", "lora_alpha": 8, "target_modules": ["q_proj"]}},
            "malformed",
        ),
        ({**_adapter(), "_extra_state": {"r": 0, "lora_alpha": 8, "target_modules": ["q_proj"]}}, "r >= 1"),
        (
            {
                k: v
                for k, v in raysync.lora_adapter(_adapter(), alpha=8).items()
                if k != f"{P}layers.1.q_proj.lora_B.weight"
            },
            r"lora_A or lora_B alone: \['layers\.1\.q_proj'\]",
        ),
    ],
    ids=["rank", "target", "shape", "no-config", "malformed", "zero-rank", "half"],
)
def test_an_engine_adapter_refuses_a_misfit_from_the_manifest_alone(
    weights: dict[str, Any], why: str
) -> None:
    with pytest.raises(raysync.RaySyncError, match=why):
        VLLMAdapter(_engine(), "math").check(_manifest(weights))  # type: ignore[arg-type]


def test_adapters_need_an_engine_with_lora_that_keeps_them_all() -> None:
    with pytest.raises(raysync.RaySyncError, match="needs an engine created with LoRA on"):
        adapter_targets(_engine(lora=False), ["math"])  # type: ignore[arg-type]
    with pytest.raises(raysync.RaySyncError, match=f"worker_extension_cls='{WORKER_EXTENSION}'"):
        adapter_targets(_engine(extension=""), ["math"])  # type: ignore[arg-type]
    with pytest.raises(raysync.RaySyncError, match="worker_extension_cls"):
        adapter_targets(_engine(extension="collections.OrderedDict"), ["math"])  # type: ignore[arg-type]
    own = f"{__name__}.OwnWorker"  # a user's own extension, deriving from raysync's
    assert adapter_targets(_engine(extension=own), ["math"])  # type: ignore[arg-type]
    with pytest.raises(raysync.RaySyncError, match="3 adapters, more than the engine keeps"):
        adapter_targets(_engine(max_loras=2), ["a", "b", "c"])  # type: ignore[arg-type]
    assert [t.adapter_id for t in adapter_targets(_engine(), ["a", "b"])] == ["a", "b"]  # type: ignore[arg-type]


class OwnWorker(AdapterWorker):
    """A user's worker extension with raysync's method among its own."""


def _peft_like() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model named as PEFT names a LoRA model (``lora_A.<adapter>.weight``), and its layer."""
    layer = torch.nn.Module()
    layer.base_layer = torch.nn.Linear(16, 32)
    layer.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(16, 4, bias=False)})
    layer.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 32, bias=False)})
    model = torch.nn.Module()
    model.base_model = torch.nn.Module()
    model.base_model.model = torch.nn.Module()
    model.base_model.model.q_proj = layer
    model.base_model.model.norm = torch.nn.LayerNorm(16)
    model.peft_config = {"default": SimpleNamespace(lora_alpha=16, use_rslora=False)}  # type: ignore[assignment]
    return model, layer


def test_a_peft_like_model_gives_its_adapter_alone_and_refuses_what_plain_lora_cannot_carry() -> None:
    model, _ = _peft_like()
    weights = raysync.lora_adapter(model)
    assert sorted(weights) == ["_extra_state", f"{P}q_proj.lora_A.weight", f"{P}q_proj.lora_B.weight"]
    assert weights["_extra_state"]["lora_alpha"] == 16.0 and weights["_extra_state"]["r"] == 4
    with pytest.raises(raysync.RaySyncError, match="no adapter 'other'"):
        raysync.lora_adapter(model, adapter_name="other")
    model.peft_config = {"default": SimpleNamespace(lora_alpha=16, use_dora=True)}  # type: ignore[assignment]
    with pytest.raises(raysync.RaySyncError, match=r"uses \['use_dora'\]"):
        raysync.lora_adapter(model)


def test_peft_views_hold_the_peft_models_own_tensors_under_the_pushed_names() -> None:
    model, layer = _peft_like()
    base, adapter = raysync.peft_views(model)
    assert sorted(base.state_dict()) == ["norm.bias", "norm.weight", "q_proj.bias", "q_proj.weight"]
    assert sorted(adapter.state_dict()) == sorted(raysync.lora_adapter(model))  # the config too
    with torch.no_grad():  # what applying a version does: written in place, into the PEFT model's own tensors
        adapter.state_dict()[f"{P}q_proj.lora_B.weight"].copy_(torch.ones(32, 4))
        base.state_dict()["q_proj.weight"].copy_(torch.full((32, 16), 2.0))
    assert torch.equal(layer.lora_B["default"].weight, torch.ones(32, 4))
    assert torch.equal(layer.base_layer.weight, torch.full((32, 16), 2.0))
    with pytest.raises(raysync.RaySyncError, match="with an adapter 'other'"):
        raysync.peft_views(model, "other")
