"""Who may touch what, read from the source (imports and attribute names):

- the slot owner (engine/slot_owner.py) is the one holder of a slot's contexts: no
  other module of inference_svc names the speculative decoder or the contexts, or
  makes a raw slot-state call but on the owner;
- the engine imports no sessions, no storage (slot files, codecs, stores);
- SlotManager (storage/slots.py) imports nothing of the core but its error type;
- slotfile.py reads the core's constants from its header (core.header); of the compiled
  binding it calls only the KV type's byte size, at run time;
- the engine, the scheduler, the sessions, the storage layer and the errors import
  without the compiled core;
- the inference service imports from snapshot_svc only the client package and the
  shared helpers (clientlib); the client package imports only itself, the generated
  stubs and clientlib; bench and tools add only the harness that starts a server."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "inference_svc"

# what reaches into a slot's contexts: the decoder and the contexts (any use), and the
# raw state calls of Context and SpecDecoder
RAW_NAMES = {"dec", "_dec", "tctx", "dctx", "hctx", "_tctx", "_dctx", "_hctx", "SpecDecoder"}
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


OWNER = SERVICE / "engine" / "slot_owner.py"


def _on_owner(call: ast.Call) -> bool:
    """A method call whose receiver is the slot owner (`owner.x()`, `self.owner.x()`)."""
    assert isinstance(call.func, ast.Attribute)
    recv = call.func.value
    return (isinstance(recv, ast.Name) and recv.id == "owner") or (
        isinstance(recv, ast.Attribute) and recv.attr == "owner")


def test_only_the_slot_owner_touches_a_slots_contexts() -> None:
    found = []
    for path in service_modules():
        if path == OWNER:
            continue
        for node in ast.walk(tree(path)):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.id if isinstance(node, ast.Name) else None)
            call = (node.func.attr if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute) else None)
            if name in RAW_NAMES or (call in RAW_CALLS and not _on_owner(node)):
                found.append(f"{rel(path)}:{node.lineno} {name or call}")
    assert found == []
    # the rule sees the owner's own use of them
    assert any(isinstance(n, ast.Name) and n.id == "SpecDecoder" for n in ast.walk(tree(OWNER)))


def test_contexts_are_opened_by_the_slot_owner_and_the_one_shot_completer_only() -> None:
    opened = {rel(p) for p in service_modules() for node in ast.walk(tree(p))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "Context"}
    assert opened == {"engine/slot_owner.py", "complete.py"}


def test_engine_and_slot_manager_keep_to_their_concerns() -> None:
    engine = {m for p in (SERVICE / "engine").glob("*.py") for m in imported(p)}
    assert "inference_svc.core.speculative" in engine  # the rule reads real imports
    assert {m for m in engine if m.startswith(("inference_svc.storage",
                                                "inference_svc.sessions"))} == set()
    slots = imported(SERVICE / "storage" / "slots.py")
    core = {m for m in slots if m.startswith("inference_svc.core")}
    assert core == {"inference_svc.core.errors", "inference_svc.core.errors.BadStateError"}
    slotfile = imported(SERVICE / "storage" / "slotfile.py")
    from_core = {m for m in slotfile if m.startswith("inference_svc.core")}
    # the constants from the header; a KV type's byte size is the core's own rule, called
    # (inside the function that needs it), not copied
    assert from_core == {"inference_svc.core", "inference_svc.core.header",
                         "inference_svc.core.binding", "inference_svc.core.binding.kv_type_bytes"}


# every module of these layers imports while the compiled core cannot be loaded
WITHOUT_C = ["inference_svc.errors", "inference_svc.config", "inference_svc.types",
             "inference_svc.engine.scheduler", "inference_svc.engine.executor",
             "inference_svc.engine.draft_length", "inference_svc.sessions.host",
             "inference_svc.storage.slots", "inference_svc.storage.slotfile",
             "inference_svc.storage.snapshot_store", "inference_svc.storage.autosave",
             # the scheduler's tests run on a fake executor and clock, the RAM tier's on
             # a fake engine and slot owner: without the core
             "tests.test_scheduler", "tests.test_session_scheduler", "tests.test_draft_length",
             "tests.test_session_tiers_unit"]
_BLOCK_C = """
import importlib, sys
class NoCore:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("inference_svc.core._native"):
            raise ImportError("the compiled core is blocked: " + name)
sys.meta_path.insert(0, NoCore())
for m in sys.argv[1:]:
    importlib.import_module(m)
assert not [m for m in sys.modules if m.startswith("inference_svc.core._native")]
assert "inference_svc.core.binding" not in sys.modules
"""


def _import_without_c(*modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_C, *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_engine_sessions_storage_and_errors_import_without_the_compiled_core() -> None:
    r = _import_without_c(*WITHOUT_C)
    assert (r.returncode, r.stderr) == (0, "")
    # the blocker works: the slot owner, which opens contexts, cannot import
    r = _import_without_c("inference_svc.engine.slot_owner")
    assert r.returncode == 1 and "the compiled core is blocked" in r.stderr


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
