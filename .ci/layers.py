"""raysync's layers, enforced: no import cycle (lazy imports count) and no upward import.

Run by ``make lint`` (and ``tests/unit/test_layers.py``). Exits 1 naming every offence.

Layers, lowest first: a module may import its own package and any package below it.
``TYPE_CHECKING`` imports are annotations only and do not count.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "raysync"

LAYERS: list[set[str]] = [
    {"errors", "_checks", "_protocol", "_compat"},  # plain Python, no Ray, no torch (but _compat's uses)
    {"core"},  # torch only: layout, codec, bound model
    {"transports"},  # data paths, both sides; the doorbell
    {"hub"},  # the hub and relay processes: state, delivery, relays, mailbox, metrics (no torch)
    {"client"},  # the trainer's side: HubClient, connect, push pipeline, writer lease, waits
    {"channels"},  # per-worker links: pipe, shared memory, RPC, torch.distributed
    {"receivers"},  # @synced_model, follower, module transform
    {"torchrl"},  # the torchrl-style API and the torchrl integration
    {"adapters"},  # receivers that are not Ray actors, per placement-group bundle
    {"engines"},  # inference engines as receivers
    {"ops"},  # the raysync command, the cluster check
    {"raysync", "schemes", "__main__"},  # the public face
]


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    found = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name and not name.startswith(m + ".") and m != "raysync"}


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "raysync"


def layer(module: str) -> int:
    p = package(module)
    for i, members in enumerate(LAYERS):
        if p in members:
            return i
    raise SystemExit(f"{module}: package {p!r} is in no layer of .ci/layers.py: add it where it belongs")


def offences(root: pathlib.Path = ROOT) -> list[str]:
    known = modules(root)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    found = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer(dep) > layer(name):
                found.append(f"upward import: {name} ({package(name)}) imports {dep} ({package(dep)})")
    seen: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> None:
        if node in stack:
            found.append("import cycle: " + " -> ".join([*stack[stack.index(node) :], node]))
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for dep in sorted(graph[node]):
            visit(dep)
        stack.pop()

    for node in sorted(graph):
        visit(node)
    return found


HUB_NEVER_IMPORTS = ("torch", "tensordict", "torchrl")  # the hub holds refs, never tensors


def import_time_imports(path: pathlib.Path) -> set[str]:
    """Every name imported when ``path`` is imported: its module body, not its functions' bodies."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                walk(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module)
                out.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    walk(
                        [n for n in inner if isinstance(n, ast.stmt)]
                        + [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body]
                    )

    walk(tree.body)
    return out


def hub_offences(root: pathlib.Path = ROOT) -> list[str]:
    """The hub's processes import neither torch (nor tensordict, torchrl) nor the trainer's side."""
    known = modules(root)
    direct = {name: import_time_imports(path) for name, path in known.items()}
    found = []
    for start in sorted(m for m in known if package(m) == "hub"):
        seen: dict[str, str] = {start: ""}
        todo = [start]
        while todo:
            name = todo.pop()
            for dep in sorted(direct.get(name, ())):
                if dep.split(".")[0] in HUB_NEVER_IMPORTS:
                    chain = [name]
                    while seen[chain[-1]]:
                        chain.append(seen[chain[-1]])
                    found.append(f"the hub imports {dep}: " + " <- ".join(chain))
                elif dep in known and dep not in seen:
                    if package(dep) == "client":
                        found.append(f"the hub imports the trainer's side: {name} imports {dep}")
                    seen[dep] = name
                    todo.append(dep)
    return sorted(set(found))


def main() -> int:
    found = offences() + hub_offences()
    for line in found:
        print(line)
    print(f"layers: {len(found)} offence(s) in {len(modules())} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
