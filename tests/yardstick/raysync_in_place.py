"""pytest plugin: raysync's scheme classes in place of torchrl's, for torchrl's own tests.

torchrl's collectors are imported first, so they keep torchrl's ABC; the test
modules, which import ``from torchrl.weight_update import X`` afterwards, get
raysync's ``X``. Used by ``run_torchrl_tests.py``.
"""

import torchrl.collectors  # bound first: torchrl's own WeightSyncScheme stays in the collectors
import torchrl.collectors.distributed
import torchrl.envs.transforms.module  # noqa: F401
import torchrl.weight_update as torchrl_weight_update

from raysync import schemes

SWAPPED = [
    "MultiProcessWeightSyncScheme",
    "NoWeightSyncScheme",
    "RayModuleTransformScheme",
    "RayWeightSyncScheme",
    "SharedMemWeightSyncScheme",
    "WeightStrategy",
    "WeightSyncScheme",
]

for _name in SWAPPED:
    setattr(torchrl_weight_update, _name, getattr(schemes, _name))
