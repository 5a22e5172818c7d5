"""The draft state on one live process (issue 7, item 4): save, then restore over
a later turn and compare that turn with a control that never restored.

With the .drft sidecar the draft proposes exactly what it would have; without it,
'reprefill' rebuilds the same draft KV (same acceptance, the whole context as
draft prompt) and 'empty' starts the draft blind (lower acceptance). The output
tokens are the target's in every case."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.servicekit import model_pair
from tests.resumekit import InferenceProcess, Session

pytestmark = pytest.mark.slow

# The pair is a 2-layer target and a perturbed copy of it as the draft: a draft that
# reads its context the way the target does, so the context it lacks under 'empty'
# shows. (The bundled 1-layer draft gains little from long contexts.)
N_HISTORY, N_NEW = 360, 60  # + 2 x 40 generated: 500 of 512 positions


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    target, draft = model_pair(tmp_path_factory.getbasetemp())
    # the draft model's state is the subject: the lookup drafter, whose state is the
    # slot's tokens, would draft some of the steps the draft model is measured on
    return ("--model", str(target), "--draft", str(draft), "--slots", "1", "--ctx", "512",
            "--threads", "1", "--no-auto-save", "--no-spec-lookup")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def live(base: tuple[str, ...],
         store: Path) -> Iterator[tuple[InferenceProcess, Session, list[int], object]]:
    """A session saved as 'ds', then the control turn on top of it."""
    with InferenceProcess(*base, "--slot-save-path", str(store)) as p:
        toks = [(7 * i * i + 3 * i) % 250 for i in range(N_HISTORY + N_NEW)]
        s = Session(max_tokens=40)
        s.turn(p, toks[:N_HISTORY])
        saved = p.client.save(0, "ds")
        assert saved.draft_saved and saved.n_saved == len(s.history)
        history = list(s.history)
        control = s.turn(p, toks[N_HISTORY:])
        s.history = history
        yield p, s, toks[N_HISTORY:], control


def turn_after_restore(p: InferenceProcess, s: Session, new: list[int]) -> tuple:
    restored = p.client.restore(0, "ds")
    assert restored.n_restored == len(s.history)
    history = list(s.history)
    t = s.turn(p, new)
    s.history = history
    return restored, t


def test_with_sidecar_the_draft_is_as_if_never_saved(live: tuple) -> None:
    p, s, new, control = live
    restored, t = turn_after_restore(p, s, new)
    assert restored.draft_restored
    assert t.tokens == control.tokens
    assert (t.timings.draft_n, t.timings.draft_n_accepted) == (
        control.timings.draft_n, control.timings.draft_n_accepted)
    assert t.timings.draft_prompt_n == control.timings.draft_prompt_n == len(new)
    assert t.timings.prompt_n == len(new)


def test_without_sidecar_reprefill_keeps_acceptance(live: tuple, store: Path) -> None:
    p, s, new, control = live
    sidecar = store / "ds.drft"
    kept = sidecar.read_bytes()
    sidecar.unlink()
    try:
        restored, t = turn_after_restore(p, s, new)
    finally:
        sidecar.write_bytes(kept)
    assert not restored.draft_restored
    assert t.tokens == control.tokens
    assert (t.timings.draft_n, t.timings.draft_n_accepted) == (
        control.timings.draft_n, control.timings.draft_n_accepted)
    assert t.timings.draft_prompt_n == len(s.history) + len(new)  # the whole context
    assert t.timings.prompt_n == len(new)


def test_without_sidecar_empty_draft_accepts_less(live: tuple, store: Path,
                                                  base: tuple[str, ...]) -> None:
    _, s, new, control = live
    copy = store.parent / "empty-policy"
    copy.mkdir(exist_ok=True)
    (copy / "ds").write_bytes((store / "ds").read_bytes())  # the target file only
    with InferenceProcess(*base, "--slot-save-path", str(copy),
                          "--draft-restore-policy", "empty") as q:
        restored, t = turn_after_restore(q, s, new)
    assert not restored.draft_restored
    assert t.tokens == control.tokens
    assert t.timings.draft_prompt_n == len(new)
    rate = t.timings.draft_n_accepted / t.timings.draft_n
    control_rate = control.timings.draft_n_accepted / control.timings.draft_n
    assert control.timings.draft_n_accepted > 0
    assert rate < control_rate
