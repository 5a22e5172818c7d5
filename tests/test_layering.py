"""Who may touch what, read from the source (imports and attribute names):

- the engine is the one owner of a slot's contexts: no other module of
  inference_svc reaches the speculative decoder or a raw context's slot state;
- the engine imports no slot-file, codec or store code, and SlotManager
  (slots.py) imports nothing of the core but its error type;
- slotfile.py reads the core's constants through the binding only;
- the inference service imports from snapshot_svc only the client package and the
  shared helpers (clientlib); the client package imports only itself, the generated
  stubs and clientlib; bench and tools add only the harness that starts a server."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "inference_svc"

# what reaches into a slot's contexts: the decoder and the contexts the engine holds
# (any use), and the raw state calls of Context and SpecDecoder
RAW_NAMES = {"dec", "tctx", "dctx", "SpecDecoder"}
RAW_CALLS = {"get_state", "set_state", "set_state_parts", "draft_state", "set_draft_state",
             "draft_reset", "draft_catch_up", "draft_sync", "slot_state", "set_slot_state",
             "prefill_chunk"}


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imported(path: Path) -> set[str]:
    """Every module `path` imports, and every `module.name` it imports from one."""
    out: set[str] = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def service_modules() -> list[Path]:
    return sorted(p for p in SERVICE.rglob("*.py") if "pb" not in p.relative_to(SERVICE).parts)


def rel(path: Path) -> str:
    return path.relative_to(SERVICE).as_posix()


EXECUTOR = SERVICE / "engine" / "executor.py"


def test_only_the_engine_touches_a_slots_contexts() -> None:
    found = []
    for path in service_modules():
        if path == EXECUTOR:
            continue
        for node in ast.walk(tree(path)):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.id if isinstance(node, ast.Name) else None)
            call = (node.func.attr if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute) else None)
            if name in RAW_NAMES or call in RAW_CALLS:
                found.append(f"{rel(path)}:{node.lineno} {name or call}")
    assert found == []


def test_contexts_are_opened_by_the_engine_and_the_one_shot_completer_only() -> None:
    opened = {rel(p) for p in service_modules() for node in ast.walk(tree(p))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "Context"}
    assert opened == {"engine/executor.py", "complete.py"}


def test_engine_and_slot_manager_keep_to_their_concerns() -> None:
    engine = {m for p in (SERVICE / "engine").glob("*.py") for m in imported(p)}
    assert engine and not {m for m in engine if m.startswith("inference_svc.storage")}
    slots = imported(SERVICE / "storage" / "slots.py")
    core = {m for m in slots if m.startswith("inference_svc.core")}
    assert core == {"inference_svc.core", "inference_svc.core.BadStateError"}
    slotfile = imported(SERVICE / "storage" / "slotfile.py")
    from_core = {m for m in slotfile if m.startswith("inference_svc.core")}
    assert "inference_svc.core.binding.lib" in from_core
    assert {m for m in from_core
            if m != "inference_svc.core.binding"
            and not m.startswith("inference_svc.core.binding.")} == set()


def _snapshot_imports(path: Path) -> set[str]:
    return {m for m in imported(path) if m.split(".")[0] == "snapshot_svc"}


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


CLIENT = "snapshot_svc.client"  # the client package: what the inference side imports
CLIENTLIB = "snapshot_svc.clientlib"  # helpers both services share
STUBS = "snapshot_svc.pb"
HARNESS = "snapshot_svc.testing"  # runs a snapshot server (in a process) for a benchmark
# benchmarks of the snapshot service itself, which measure its server-side layers
SNAPSHOT_BENCHES = {"snapshot.py", "snapshot_s3.py", "store_generations.py"}


def test_the_inference_service_imports_only_the_client_package_and_clientlib() -> None:
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in SERVICE.rglob("*.py") if "pb" not in p.parts
           for m in _snapshot_imports(p) if not _within(m, CLIENT, CLIENTLIB)]
    assert bad == []
    assert any(_within(m, CLIENT) for p in SERVICE.rglob("*.py") for m in _snapshot_imports(p))


def test_the_client_package_depends_only_on_itself_the_stubs_and_clientlib() -> None:
    client = list((ROOT / "snapshot_svc" / "client").rglob("*.py"))
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in client
           for m in _snapshot_imports(p) if not _within(m, CLIENT, CLIENTLIB, STUBS)]
    shared = list((ROOT / "snapshot_svc" / "clientlib").rglob("*.py"))
    bad += [f"{p.relative_to(ROOT)}: {m}" for p in shared
            for m in _snapshot_imports(p) if not _within(m, CLIENTLIB)]
    assert client and shared and bad == []


def test_bench_and_tools_reach_the_snapshot_service_as_a_user_does() -> None:
    bad = []
    for p in sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "tools").glob("*.py")]):
        if p.parent.name == "bench" and p.name in SNAPSHOT_BENCHES:
            continue
        bad += [f"{p.relative_to(ROOT)}: {m}" for m in _snapshot_imports(p)
                if not _within(m, CLIENT, CLIENTLIB, HARNESS)]
    assert bad == []
    for name in SNAPSHOT_BENCHES:  # the exceptions exist and still need to be exceptions
        assert not all(_within(m, CLIENT, CLIENTLIB, HARNESS)
                       for m in _snapshot_imports(ROOT / "bench" / name)), name


def test_each_layer_of_the_service_says_what_it_owns_and_may_import() -> None:
    layers = sorted(p.parent.name for p in SERVICE.glob("*/__init__.py") if p.parent.name != "pb")
    assert layers == ["api", "core", "engine", "sessions", "storage"]
    for name in layers:
        doc = ast.get_docstring(tree(SERVICE / name / "__init__.py")) or ""
        assert "import" in doc, name  # what it may import, beside what it owns
