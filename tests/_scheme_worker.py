"""A worker process for tests/test_schemes.py: serves several schemes on their pipes.

Kept apart from the test module so a spawned child imports only torch and raysync.
"""

from __future__ import annotations

from typing import Any

import torch


def net(seed: int, *, out: int = 4) -> torch.nn.Module:
    """Parameters and buffers (BatchNorm: float running stats and an int64 counter)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, out))


def serve(specs: list[tuple[str, Any, Any, int]]) -> None:
    """Run receivers until every pipe says "close".

    specs: (model_id, scheme, pipe, seed) per model; commands arrive on the same pipe as the
    weights (so they also show that control messages are never dropped).
    """
    models: dict[str, torch.nn.Module] = {}
    for model_id, scheme, pipe, seed in specs:
        models[model_id] = net(seed)
        scheme.init_on_receiver(model_id=model_id, pipe=pipe, model=models[model_id])
    open_ids = {model_id for model_id, *_ in specs}
    while open_ids:
        for model_id, scheme, _, _ in specs:
            if model_id not in open_ids:
                continue
            receiver = scheme.get_receiver()
            receiver.receive(timeout=0.01)
            command = receiver.transport.next_message(0.0)
            if command is None:
                continue
            model = models[model_id]
            if command == "close":
                open_ids.discard(model_id)
                scheme.shutdown()
                continue
            if command == "state":
                reply: Any = {k: v.clone() for k, v in model.state_dict().items()}
            elif command == "params":
                reply = {
                    "ids": [id(p) for p in model.parameters()],
                    "keys": list(model.state_dict()),
                    "count": receiver.version_count,
                    "error": None if receiver.last_error is None else str(receiver.last_error),
                }
            else:
                reply = ("unknown command", command)
            receiver.transport.send_message((command, reply))


def shared_mem_worker(transport: Any, worker_idx: int, commands: Any, replies: Any) -> None:
    """torchrl 0.14's call shapes of a SharedMemTransport, worker side.

    Takes this worker's shared weights from its queue, then on each ``"apply"`` copies
    them into its own model and replies with the model's state dict; stops on ``"close"``.
    """
    shared = transport.setup_connection_and_weights_on_receiver(worker_idx=worker_idx, timeout=120)
    model = net(10 + worker_idx)
    while commands.get(timeout=120) == "apply":
        transport.receive_weights(weights=shared, model=model)
        replies.put({k: v.detach().clone() for k, v in model.state_dict().items()})
