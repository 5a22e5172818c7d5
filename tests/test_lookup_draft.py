"""The lookup drafter: its matching rule, greedy output identical to target-only,
the speculative-sampling law with certain proposals, batches, and the step's
report of which drafter proposed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, InvalidArgumentError, Model
from inference_svc.core.speculative import (
    LOOKUP_MAX_MATCH,
    NO_SPEC,
    Drafter,
    SamplingParams,
    SpecDecoder,
    SpecParams,
    lookup,
    lookup_lengths,
)
from tests.gemma3kit import gemma_path, needs_gemma3
from tests.test_speculative import (
    GREEDY,
    chi2_pvalue,
    exact_dist,
    open_decoder,
    pair,  # noqa: F401 - the module fixture, used by name
    step_together,
    target_only_greedy,
)

pytestmark = pytest.mark.native

# a prompt that repeats itself, so the lookup drafter finds matches from the start
REPEATING = [5, 17, 250, 3, 99, 42, 7, 5, 17, 250, 3, 99, 42, 7, 5, 17]


@pytest.mark.parametrize("toks, min_match, k, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 2, 3, [4, 1, 2]),            # the longest suffix [1, 2, 3]
    ([7, 1, 9, 7, 1, 8, 7, 1], 2, 1, [8]),               # equal matches: the most recent
    ([5, 7, 1, 9, 7, 1, 8, 5, 7, 1], 2, 1, [9]),         # a longer match beats a recent one
    ([1, 2, 3, 4], 1, 2, []),                            # the last token never occurred
    ([1, 2, 9, 2], 2, 1, []),                            # shorter than min_match
    ([1, 2, 9, 2], 1, 1, [9]),
    ([3, 4, 3, 4, 3], 1, 5, [4, 3, 4, 3, 4]),            # past the end: its own proposals
    ([6, 6, 6], 1, 4, [6, 6, 6, 6]),
    ([], 1, 3, []),
    ([8], 1, 3, []),
    ([1, 2, 1, 2], 2, 0, []),
])
def test_lookup_rule(toks: list[int], min_match: int, k: int, expected: list[int]) -> None:
    assert lookup(toks, min_match, k) == expected


def test_lookup_match_is_capped() -> None:
    """A suffix longer than LOOKUP_MAX_MATCH matches on its last LOOKUP_MAX_MATCH
    tokens: the most recent such occurrence wins over an older, longer one."""
    body = list(range(100, 100 + LOOKUP_MAX_MATCH + 4))
    toks = body + [1] + body[4:] + [2] + body
    assert lookup(toks, LOOKUP_MAX_MATCH, 1) == [2]
    assert lookup(toks, LOOKUP_MAX_MATCH + 0, 1) == [2]


@pytest.mark.parametrize("min_match, k", [(0, 1), (LOOKUP_MAX_MATCH + 1, 1), (1, 17), (1, -1)])
def test_lookup_rule_refuses_bad_arguments(min_match: int, k: int) -> None:
    with pytest.raises(InvalidArgumentError):
        lookup([1, 2, 1], min_match, k)


@pytest.fixture(scope="module")
def repeating_reference(pair: tuple[Path, Path, Path]) -> list[int]:  # noqa: F811
    with Model.load(pair[0]) as m, Context(m, n_ctx=256) as ctx:
        return target_only_greedy(ctx, REPEATING, 60)


def run_steps(dec: SpecDecoder, slot: int, prompt: list[int], n_new: int,
              sp: SamplingParams, spec: SpecParams) -> tuple[list[int], dict[Drafter, list[int]]]:
    """Prefill, then step_batch one slot at a time: the tokens, and per drafter the
    [drafted, accepted] counts the steps reported."""
    out = [dec.prefill(slot, prompt, sp, with_draft=spec.n_max > 0)]
    by: dict[Drafter, list[int]] = {d: [0, 0] for d in Drafter}
    while len(out) < n_new:
        r = dec.step_batch([slot], [sp], [spec], [n_new - len(out)])[0]
        assert (r.drafter == Drafter.NONE) == (r.drafted == 0)
        by[r.drafter][0] += r.drafted
        by[r.drafter][1] += len(r.tokens) - 1
        out += r.tokens
    return out, by


@pytest.mark.parametrize("n_lookup", list(range(1, 17)))
def test_greedy_lookup_equals_target_only(pair: tuple[Path, Path, Path],  # noqa: F811
                                          repeating_reference: list[int], n_lookup: int) -> None:
    for dec in open_decoder(pair[0], None):
        out, by = run_steps(dec, 0, REPEATING, 60, GREEDY,
                            SpecParams(n_max=0, lookup_k=lookup_lengths(n_lookup, 2)))
        assert out == repeating_reference
        assert by[Drafter.MODEL] == [0, 0]
        drafted, accepted = by[Drafter.LOOKUP]
        assert 0 < accepted <= drafted  # no draft model: lookup alone proposed
        c = dec.counters(0)
        assert (c.n_drafted, c.n_accepted) == (drafted, accepted)
        assert dec.tokens(0) == REPEATING + out


def test_lookup_and_draft_model_share_a_request(pair: tuple[Path, Path, Path],  # noqa: F811
                                                repeating_reference: list[int]) -> None:
    """Where lookup finds a match it drafts and the draft model sits out (and catches
    up later); elsewhere the model drafts: the output stays the target's."""
    for dec in open_decoder(pair[0], pair[1]):
        out, by = run_steps(dec, 0, REPEATING, 60, GREEDY,
                            SpecParams(n_max=4, lookup_k=lookup_lengths(4, 3)))
        assert out == repeating_reference
        assert by[Drafter.LOOKUP][0] > 0 and by[Drafter.MODEL][0] > 0
        assert dec.tokens(0) == REPEATING + out
        # the draft's KV is a prefix of the target's: it catches up, nothing lost
        dec.commit(0)
        dec.draft_sync(0)
        assert dec.draft_n_tokens(0) + dec.draft_offset(0) == dec.n_tokens(0)


def test_lookup_off_never_drafts(pair: tuple[Path, Path, Path],  # noqa: F811
                                 repeating_reference: list[int]) -> None:
    for dec in open_decoder(pair[0], None):
        out, by = run_steps(dec, 0, REPEATING, 30, GREEDY, SpecParams(n_max=8))
        assert out == repeating_reference[:30]
        assert by[Drafter.LOOKUP] == [0, 0] and by[Drafter.MODEL] == [0, 0]


def test_batched_lookup_equals_separate_steps(pair: tuple[Path, Path, Path]) -> None:  # noqa: F811
    """Two slots stepping together (lookup in one, the model in the other, sampled)
    give the tokens each gives alone."""
    sp = SamplingParams(temperature=0.9, top_k=20)
    prompts = [REPEATING, [9, 8, 7, 6, 5, 4, 3, 2]]
    spec = SpecParams(n_max=3, lookup_k=lookup_lengths(5))
    alone = []
    for dec in open_decoder(pair[0], pair[1]):
        for slot, p in enumerate(prompts):
            dec.seed(slot, 11 + slot)
            alone.append(run_steps(dec, slot, p, 40, sp, spec)[0])
    for dec in open_decoder(pair[0], pair[1]):
        outs, kinds = step_together(dec, prompts, sp, [spec, spec], 40, seed0=11)
        assert outs == alone
        assert {Drafter.LOOKUP, Drafter.MODEL} <= kinds


def conditionals(ctx: Context, prompt: list[int],
                 sp: SamplingParams) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """The target's law of t1 after the prompt, and of t2 after each likely t1."""
    ctx.clear(0)
    p1 = exact_dist(ctx.decode(0, prompt), sp)
    cond = {}
    for t1 in np.flatnonzero(p1):
        ctx.truncate(0, len(prompt))
        cond[int(t1)] = exact_dist(ctx.decode(0, [int(t1)]), sp)
    return p1, cond


def test_lookup_sampling_distribution_matches_target(
        pair: tuple[Path, Path, Path]) -> None:  # noqa: F811
    """Pairs (t1, t2): t1 from prefill, t2 from a step whose first proposal is the
    lookup drafter's (every token occurs in the prompt, so a match always exists):
    accepted with probability p(x), else drawn from p without x. The joint law is
    the target's. The prompt holds, for each likely t1, its end followed by t1 and
    a likely t2, so that proposals are accepted often enough to test both branches."""
    sp = SamplingParams(temperature=1.0, top_k=6)
    tail = [5, 17, 250, 3, 99, 42, 7]
    filler = [(7 * i + 3) % 300 for i in range(300)]
    runs = 3000
    with Model.load(pair[0]) as m, Context(m, n_ctx=512) as ctx:
        for _ in range(6):
            prompt = filler + tail
            p1, cond = conditionals(ctx, prompt, sp)
            props = {a: lookup(prompt + [a], 1, 1)[0] for a in cond}
            if all(cond[a][props[a]] > 0.1 for a in cond):
                break
            for a in cond:
                filler += [42, 7, a, int(np.argmax(cond[a]))]
        else:
            pytest.fail("no prompt whose proposals are likely")
    pairs = [(a, b) for a in cond for b in range(300)]
    expected = np.array([p1[a] * cond[a][b] for a, b in pairs]) * runs
    index = {ab: i for i, ab in enumerate(pairs)}
    counts = np.zeros(len(index))
    spec = SpecParams(n_max=0, lookup_k=lookup_lengths(1))
    for dec in open_decoder(pair[0], None, n_slots=1, n_ctx=512):
        dec.prefill(0, prompt[:-1], sp)
        for seed in range(runs):
            dec.truncate(0, len(prompt) - 1)
            dec.seed(0, seed)
            t1 = dec.prefill(0, prompt[-1:], sp)
            r = dec.step_batch([0], [sp], [spec], [2])[0]
            assert (r.drafter, r.drafted) == (Drafter.LOOKUP, 1)
            counts[index[(t1, r.tokens[0])]] += 1
        c = dec.counters(0)
        assert c.n_drafted == runs and 0.05 * runs < c.n_accepted < runs  # both branches
    assert chi2_pvalue(counts, expected) > 1e-3
    # the test can fail: always keeping the proposal is measurably another law
    kept = np.zeros(len(index))
    for a in cond:
        kept[index[(a, lookup(prompt + [a], 1, 1)[0])]] = p1[a] * runs
    assert chi2_pvalue(kept, expected) < 1e-6


def test_bad_lookup_parameters_fail_before_decoding(
        pair: tuple[Path, Path, Path]) -> None:  # noqa: F811
    for dec in open_decoder(pair[0], None):
        dec.prefill(0, REPEATING, GREEDY)
        n = dec.n_tokens(0)
        for spec, what in ((SpecParams(n_max=0, lookup_k=lookup_lengths(17)),
                            r"lookup_k\[1\] = 17"),
                           (SpecParams(n_max=0, lookup_k=(0,) * 15 + (-1,)),
                            r"lookup_k\[16\] = -1")):
            with pytest.raises(InvalidArgumentError, match=what):
                dec.step_batch([0], [GREEDY], [spec], [4])
            with pytest.raises(InvalidArgumentError, match=what):
                dec.step(0, GREEDY, spec, 4)
        assert dec.n_tokens(0) == n
        assert dec.step(0, GREEDY, NO_SPEC, 1)  # the slot still works


@needs_gemma3
def test_gemma3_lookup_past_the_window_equals_target_only() -> None:
    """On Gemma 3 (no draft model), looking up 16 tokens at every repeat of a prompt
    longer than its sliding window: each verification writes 17 positions into the
    rings and rolls back the rejected ones. Greedy output stays the target's."""
    from pydoc_data.topics import topics

    with Model.load(gemma_path()) as m:
        text = m.tokenizer.encode(topics["assert"])[:300]
        prompt = text * 3 + text[:40]  # past the 512-token window, ending in a repeat
        with Context(m, n_slots=1, n_ctx=1024, n_threads=2) as ctx:
            dec = SpecDecoder(ctx, None)
            plain = dec.generate(0, prompt, 48, GREEDY, NO_SPEC)
            dec.clear(0)
            looked, by = run_steps(dec, 0, prompt, 48, GREEDY,
                                   SpecParams(n_max=0, lookup_k=lookup_lengths(16)))
            dec.close()
    assert looked == plain
    drafted, accepted = by[Drafter.LOOKUP]
    assert drafted > 16 and accepted > 0
