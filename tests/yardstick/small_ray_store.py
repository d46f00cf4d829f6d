"""pytest plugin: the Ray clusters torchrl's tests start get a 1 GiB object store (a small machine)."""

from torchrl.collectors.distributed import ray as _torchrl_ray

_torchrl_ray.DEFAULT_RAY_INIT_CONFIG["object_store_memory"] = 1 << 30
