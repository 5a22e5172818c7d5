"""The draft-length controller: the length each step drafts from the acceptance
measured so far, backing off to target-only decoding with spaced probes where the
draft is useless and coming back when it is right again. Exact sequences."""

from __future__ import annotations

import pytest

from inference_svc.engine.draft_length import DraftLength, DraftLengths, lookup_band


def run(ctl: DraftLength, steps: int, accept: bool, declined: bool = False) -> list[int]:
    """The lengths asked for over `steps` steps whose proposals are all accepted or all
    rejected (declined: the draft, under its confidence threshold, proposes nothing)."""
    asked = []
    for _ in range(steps):
        n = ctl.next()
        asked.append(n)
        drafted = 0 if declined else n
        ctl.observe(n, drafted, drafted if accept else 0)
    return asked


@pytest.mark.parametrize(("acceptance", "n_max", "best"), [
    (0.0, 8, 0), (0.2, 8, 0), (0.5, 8, 1), (0.8, 8, 3), (0.8, 2, 2), (0.95, 8, 8),
    (0.95, 0, 0)])
def test_best_length_maximises_tokens_per_cost(acceptance: float, n_max: int,
                                               best: int) -> None:
    # E(k) / (1 + 0.3 k) with E(k) = 1 + a + ... + a^k; at a = 0.8: k = 1..4 give
    # 1.385, 1.525, 1.554, 1.528
    assert DraftLength.start(n_max, 0.3, acceptance).best() == best


def test_a_useless_draft_backs_off_to_spaced_probes() -> None:
    ctl = DraftLength.start(8, 0.3, 0.5)
    # two rejected single proposals bring the estimate below what one proposal costs;
    # then probes after 8, 16, 32, 64, 64 target-only steps
    expected = [1, 1]
    for gap in (8, 16, 32, 64, 64):
        expected += [0] * (gap - 1) + [1]
    assert run(ctl, len(expected), accept=False) == expected
    assert ctl.acceptance < 0.1  # the starting estimate has faded


def test_a_useful_draft_grows_to_n_max_and_a_backed_off_one_comes_back() -> None:
    ctl = DraftLength.start(8, 0.3, 0.5)
    assert run(ctl, 8, accept=True) == [1, 2, 3, 4, 6, 8, 8, 8]
    ctl = DraftLength.start(8, 0.3, 0.5)
    run(ctl, 20, accept=False)  # backed off: next probe at the 8th idle step
    assert ctl.best() == 0
    assert run(ctl, 15, accept=True) == [0] * 5 + [1, 1, 1, 2, 2, 3, 5, 7, 8, 8]


def test_a_draft_declining_to_propose_counts_as_a_rejection() -> None:
    """A draft that declines every proposal (below p_min) backs off exactly like one
    whose proposals are all rejected: it decoded for nothing."""
    declined, rejected = DraftLength.start(8, 0.3, 0.5), DraftLength.start(8, 0.3, 0.5)
    assert run(declined, 200, accept=False, declined=True) \
        == run(rejected, 200, accept=False)
    assert declined.acceptance == rejected.acceptance


def test_no_drafting_without_n_max() -> None:
    assert run(DraftLength.start(0, 0.3, 0.9), 100, accept=True) == [0] * 100


def test_lookup_lengths_by_band_from_their_priors() -> None:
    """Each band of repeat length starts from its own prior: a one-token repeat is not
    worth a proposal, a repeat of 8+ is worth n_max; the request's cap bounds them."""
    d = DraftLengths.start(8, 0.3, (8,) * 16, 0.2, 0.5)
    assert d.next() == (1, (0, 1, 2, 3, 3, 3, 3) + (8,) * 9, 0)
    capped = DraftLengths.start(0, 0.3, (0, 0) + (4,) * 14, 0.2, 0.5)
    assert capped.next() == (0, (0, 0, 2, 3, 3, 3, 3) + (4,) * 9, 0)
    assert DraftLengths.start(4, 0.3, (), 0.2, 0.5).next() == (1, (), 0)


def test_lookup_band_learns_alone() -> None:
    """Rejected long-repeat proposals shrink that band only; the draft model, which
    sat those steps out, keeps its estimate."""
    d = DraftLengths.start(8, 0.3, (8,) * 16, 0.2, 0.5)
    for _ in range(3):
        d.observe(d.next(), True, 9, 8, 0)
    assert d.next() == (1, (0, 1, 2, 3, 3, 3, 3) + (1,) * 9, 0)


def test_an_idle_lookup_band_probes_and_a_model_step_teaches_only_the_model() -> None:
    """Steps where the one-token band was asked nothing (the model drafted, and was
    wrong) idle that band towards a probe after 8; the model backs off."""
    d = DraftLengths.start(8, 0.3, (8,) * 16, 0.2, 0.5)
    for _ in range(7):
        d.observe(d.next(), False, 1, 1, 0)
    assert d.next() == (0, (1, 1, 2, 3, 3, 3, 3) + (8,) * 9, 0)
    # a step without any repeat teaches the lookup bands nothing
    before = [b.acceptance for b in d.bands]
    d.observe(d.next(), False, 0, 0, 0)
    assert [b.acceptance for b in d.bands] == before


@pytest.mark.parametrize("m, band", [(1, 0), (2, 1), (3, 2), (4, 3), (7, 3), (8, 4), (16, 4)])
def test_lookup_bands(m: int, band: int) -> None:
    assert lookup_band(m) == band


def test_head_drafts_where_lookup_does_not_and_the_model_follows_a_silent_head() -> None:
    """With a head the controller asks it first where lookup is silent; a head that
    keeps failing (rejected, or unable to draft: nothing proposed) goes idle and the
    model, which it kept from drafting, gets the steps; a head whose proposals are
    accepted keeps them, the model idle."""
    d = DraftLengths.start(4, 0.3, (), 0.2, 0.5, n_head=6, head_cost=0.3)
    assert d.next() == (1, (), 1)
    model_before = d.model.acceptance if d.model else None
    failures = 0
    while d.next()[2] > 0 and failures < 10:
        d.observe(d.next(), False, 0, 0, 0)  # the head proposed nothing
        failures += 1
    assert d.next() == (1, (), 0) and failures == 6  # the head idles (declines weigh 1/4)
    assert d.model is not None and d.model.acceptance == model_before  # it sat them out
    good = DraftLengths.start(4, 0.3, (), 0.2, 0.5, n_head=6, head_cost=0.3)
    for _ in range(5):
        asked = good.next()
        good.observe(asked, False, 0, asked[2], asked[2], by_head=True)
    assert good.next() == (1, (), 6)
    assert good.model is not None and good.model.acceptance == model_before
    # a silent head that the model then drafted for: the model learns, the head fails
    d.observe(d.next(), False, 0, 1, 1)
    assert d.model is not None and d.model.acceptance > 0.5


def test_head_declines_weigh_less_than_rejections() -> None:
    """A head that declines most steps (below p_min) and is right where it drafts keeps
    drafting; a draft model with the same record stops (its declines cost a decode)."""
    head = DraftLength(4, 0.3, accepted=2.0, tried=4.0, decline=0.25)
    model = DraftLength.start(4, 0.3, 0.5)
    for step in range(40):
        for d in (head, model):
            k = d.next()
            if step % 4 == 3:
                d.observe(k, k, k)  # drafted and all accepted
            else:
                d.observe(k, 0, 0)  # declined
    assert head.next() > 0 and head.acceptance > 0.5
    assert model.best() == 0
