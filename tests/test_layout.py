"""The layout's promises: the bus, the monitor and the proxy work in a process that has no torch; the bus's
two wings (publish, subscribe) meet only in the shared wire modules; the folders form layers and no import
runs from a lower one to a higher one; no import circles; no module over 450 lines, no class over 300."""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import subprocess
import sys

from tests.support import REPO_ROOT, make_loader, make_model

# Run Python as if torch were not installed: any import of it fails like a missing package.
NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, NoTorch())
"""


def run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-c", NO_TORCH + code, *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_bus_reads_a_real_run_without_torch(tmp_path):
    from eventbus import Trainer

    trainer = Trainer(make_model(), make_loader(num_samples=32), max_duration="2ba", run_name="no-torch")
    trainer.fit()
    trainer.close()
    journal = str(trainer.publisher.journal_path)
    code = """
import asyncio
import eventbus
from eventbus import Event, Subscriber, Snapshot, ProtocolError, Time
from eventbus.bus import config, journal, protocol, proxy, schema, security, wire
from eventbus.bus.publish import bus_thread, doorbell, history, leases, payload, publisher, records, service
from eventbus.bus.subscribe import journal_stream, messages, ranks, recovery, snapshot, stats, subscriber
from eventbus.bus.subscribe.journal_stream import journal_messages

async def main():
    batches = [int(m.state.timestamp.batch) async for m in journal_messages(sys.argv[1])
               if m.event is Event.BATCH_END]
    print("batch_end at", batches)
asyncio.run(main())
assert "torch" not in sys.modules
"""
    result = run_without_torch(code, journal)
    assert result.returncode == 0, result.stderr
    assert "batch_end at [1, 2]" in result.stdout


def test_monitor_and_proxy_help_start_without_torch():
    for command in ("monitor", "proxy"):
        result = run_without_torch("from eventbus.cli import main; sys.exit(main())", command, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout


def test_the_package_root_imports_the_training_side_only_when_asked():
    result = run_without_torch("import eventbus; from eventbus import Callback, Event, Time, Subscriber; "
                               "print(sorted(m for m in sys.modules if m.startswith('eventbus.training')))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_importing_eventbus_and_its_integrations_imports_no_trainer():
    """The adapters import their trainer when used: ``import eventbus`` (and the shared adapter
    module) must not pay seconds for Composer, Lightning or transformers."""
    code = ("import sys, eventbus, eventbus.integrations, eventbus.integrations.adapter; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'composer', 'lightning', 'pytorch_lightning', 'transformers', 'accelerate'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------- the import graph

# Each folder and the package it is imported as: the daemons' folder is installed as ``eventbus.workers``
# (``eventbus/workers`` links to it; rglob does not follow the link, so no module is read twice).
PACKAGES = {"eventbus": "eventbus", "workers": "eventbus.workers"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (REPO_ROOT / folder).rglob("*.py"):
            parts = (package, *path.relative_to(REPO_ROOT / folder).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def parsed(path: pathlib.Path) -> ast.Module:
    """A module's syntax tree, parsed once per test process (the graph tests below each read every module)."""
    return ast.parse(path.read_text())


def imports_of(path: pathlib.Path, known: dict[str, pathlib.Path], *, type_only: bool) -> set[str]:
    """The project modules ``path`` imports, wherever in the file (functions too); ``type_only``: also
    the imports under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not type_only:
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names if alias.name in known)
            elif isinstance(child, ast.ImportFrom) and child.module:
                for name in (child.module, *(f"{child.module}.{alias.name}" for alias in child.names)):
                    if name in known:
                        found.add(name)
            visit(child)

    visit(parsed(path))
    return found


@functools.cache
def import_graph(*, type_only: bool) -> dict[str, set[str]]:
    """Who imports whom in the project (built once per test process: read it, never change it)."""
    known = modules()
    return {name: imports_of(path, known, type_only=type_only) - {name} for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_bus_wings_meet_only_in_the_shared_modules():
    graph = import_graph(type_only=True)
    wings = {"publish": "eventbus.bus.publish", "subscribe": "eventbus.bus.subscribe"}
    for wing, prefix in wings.items():
        other = next(p for w, p in wings.items() if w != wing)
        members = [name for name in graph if name.startswith(prefix)]
        assert members, f"no modules in {prefix}"
        crossing = {name: sorted(i for i in graph[name] if i.startswith(other)) for name in members}
        assert not any(crossing.values()), f"the {wing} wing imports the other: {crossing}"


def test_no_import_circles_except_type_only_inside_one_folder():
    assert circles(import_graph(type_only=False)) == []
    for component in circles(import_graph(type_only=True)):
        folders = {name.rsplit(".", 1)[0] for name in component}
        assert len(folders) == 1, f"a type-only import circle across folders: {sorted(component)}"


def test_core_imports_nothing_above_it():
    graph = import_graph(type_only=True)
    for name, imported in graph.items():
        if name.startswith("eventbus.core"):
            above = sorted(i for i in imported if not i.startswith(("eventbus.core", "eventbus.errors")))
            assert above == [], f"{name} imports {above}"


# ---------------------------------------------------------------------------------------- layers and sizes

# Lowest first. A module may import its own layer and those below; the bus's two wings share a layer and
# never import each other (tested above). The package root's lazy re-exports reach every layer, so only the
# top layer (and tests) may import ``eventbus`` itself.
LAYERS = (
    ("eventbus.errors", "eventbus.version", "eventbus.core", "eventbus.distributed"),
    # Checkpoint files and staged buffers, and the trackers' writers, are read by both ends of the bus.
    ("eventbus.checkpoint", "eventbus.trackers"),
    ("eventbus.bus",),  # the shared wire modules
    ("eventbus.bus.publish", "eventbus.bus.subscribe"),
    ("eventbus.capture",),
    ("eventbus.training", "eventbus.integrations", "eventbus.runtime"),
    ("eventbus.run", "eventbus.monitor", "eventbus.export", "eventbus.cli", "eventbus.__main__"),
    ("eventbus.workers", "eventbus"),
)
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300


def layer_of(module: str) -> int:
    """The layer of the longest prefix that names ``module``'s folder (``eventbus`` alone: the root only)."""
    found = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
             if module == prefix or (prefix != "eventbus" and module.startswith(prefix + "."))]
    assert found, f"{module} is in no layer: add its folder to LAYERS"
    return max(found)[1]


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    upward = sorted(f"{name} -> {imported}" for name, imports in import_graph(type_only=True).items()
                    for imported in imports if imported != "eventbus" and layer_of(imported) > layer_of(name))
    assert upward == [], "imports that run upward:\n" + "\n".join(upward)


def test_only_the_top_layer_imports_the_package_root():
    top = len(LAYERS) - 1
    importers = sorted(name for name, imports in import_graph(type_only=True).items()
                       if "eventbus" in imports and layer_of(name) != top)
    assert importers == [], f"import the module that defines the name, not the package root: {importers}"


def test_no_module_over_450_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    over = sorted(f"{name}: {lines}" for name, lines in sizes.items() if lines > MAX_MODULE_LINES)
    assert over == [], f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_class_over_300_lines():
    over = sorted(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1}"
                  for name, path in modules().items() for node in ast.walk(parsed(path))
                  if isinstance(node, ast.ClassDef) and node.end_lineno is not None
                  and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES)
    assert over == [], f"classes over {MAX_CLASS_LINES} lines: {over}"


def folder_of(name: str, path: pathlib.Path) -> str:
    """The folder a module lives in; a module at the top of a package (``eventbus/cli.py``) is a room of its own."""
    if path.name == "__init__.py" or path.parent.name in PACKAGES:
        return name
    return name.rsplit(".", 1)[0]


def test_no_import_circle_crosses_a_folder():
    """Between folders the arrows run one way, also within a layer (``training`` and ``runtime``)."""
    known = modules()
    folders: dict[str, set[str]] = {}
    for name, imports in import_graph(type_only=True).items():
        folder = folder_of(name, known[name])
        folders.setdefault(folder, set()).update(folder_of(i, known[i]) for i in imports)
    for folder in folders:
        folders[folder].discard(folder)
    assert circles(folders) == []
