"""Who may touch what, read from the source (imports and attribute names):

- the engine is the one owner of a slot's contexts: no other module of
  inference_svc reaches the speculative decoder or a raw context's slot state;
- the engine imports no slot-file, codec or store code, and SlotManager
  (slots.py) imports nothing of the core but its error type;
- slotfile.py reads the core's constants through the binding only;
- the inference service imports from snapshot_svc only its client library, whose
  imports stay inside it (no server, storage or process-wide tuning code)."""

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
    return sorted(p for p in SERVICE.glob("*.py"))


def test_only_the_engine_touches_a_slots_contexts() -> None:
    found = []
    for path in service_modules():
        if path.name == "engine.py":
            continue
        for node in ast.walk(tree(path)):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.id if isinstance(node, ast.Name) else None)
            call = (node.func.attr if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute) else None)
            if name in RAW_NAMES or call in RAW_CALLS:
                found.append(f"{path.name}:{node.lineno} {name or call}")
    assert found == []


def test_contexts_are_opened_by_the_engine_and_the_one_shot_completer_only() -> None:
    opened = {p.name for p in service_modules() for node in ast.walk(tree(p))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "Context"}
    assert opened == {"engine.py", "complete.py"}


def test_engine_and_slot_manager_keep_to_their_concerns() -> None:
    engine = imported(SERVICE / "engine.py")
    assert not {m for m in engine if m.split(".")[1:2] in (["slotfile"], ["snapshots"],
                                                          ["store"], ["slots"])}
    core = {m for m in imported(SERVICE / "slots.py") if m.startswith("inference_svc.core")}
    assert core == {"inference_svc.core", "inference_svc.core.BadStateError"}
    from_core = {m for m in imported(SERVICE / "slotfile.py") if m.startswith("inference_svc.core")}
    assert "inference_svc.core.binding.lib" in from_core
    assert {m for m in from_core
            if m != "inference_svc.core.binding"
            and not m.startswith("inference_svc.core.binding.")} == set()


CLIENT_LIBRARY = {"snapshot_svc", "snapshot_svc.client", "snapshot_svc.errors",
                  "snapshot_svc.records", "snapshot_svc.names", "snapshot_svc.wire",
                  "snapshot_svc.digest", "snapshot_svc.buffers", "snapshot_svc.pb"}


def _in_client_library(module: str) -> bool:
    return (module in CLIENT_LIBRARY or module.startswith(("snapshot_svc.clientlib",
                                                           "snapshot_svc.pb.")))


def _module_path(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def test_the_inference_service_uses_only_the_snapshot_client_library() -> None:
    used = {m for p in service_modules() for m in imported(p) if m.startswith("snapshot_svc")}
    # `from snapshot_svc import X`: X is a name of the package, not a module
    modules = {m for m in used if _module_path(m) is not None}
    assert modules and all(_in_client_library(m) for m in modules), sorted(modules)
    # and the library's own imports stay inside it
    seen: set[str] = set()
    todo = sorted(modules)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        path = _module_path(m)
        assert path is not None
        for dep in imported(path):
            if dep.startswith("snapshot_svc") and _module_path(dep) is not None:
                assert _in_client_library(dep), f"{m} imports {dep}"
                todo.append(dep)
    assert "snapshot_svc.client" in seen and "snapshot_svc.memory" not in seen
