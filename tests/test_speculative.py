"""Speculative decoding in the core: exact greedy output, the sampling rule's
distribution, draft state, counters and parameter validation."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from inference_svc.core import (
    BadStateError,
    Context,
    ContextFullError,
    InvalidArgumentError,
    Model,
)
from inference_svc.core.speculative import (
    NO_SPEC,
    Drafter,
    SamplingParams,
    SpecDecoder,
    SpecParams,
)
from tests.factory import Shape, write_model

pytestmark = pytest.mark.native

TARGET = Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
GREEDY = SamplingParams()
PROMPT = [5, 17, 250, 3, 99, 42, 7]


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> None:
    """The same model with noise on every matrix: a draft that agrees often, not always."""
    reader = gguf.GGUFReader(str(src))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(dst), "llama")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        val = f.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(f.name, val)
        else:
            w.add_key_value(f.name, val, vtype)
    for t in reader.tensors:
        arr = np.asarray(t.data, dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(t.shape.tolist())))
        if arr.ndim == 2:
            arr = arr + noise * rng.standard_normal(arr.shape).astype(np.float32) * arr.std()
        w.add_tensor(t.name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("spec")
    target, draft, same = d / "target.gguf", d / "draft.gguf", d / "same.gguf"
    write_model(target, TARGET, seed=3)
    perturbed_copy(target, draft, noise=0.35)
    perturbed_copy(target, same, noise=0.0)
    return target, draft, same


def open_decoder(target: Path, draft: Path | None, n_slots: int = 2,
                 n_ctx: int = 256) -> Iterator[SpecDecoder]:
    tm = Model.load(target)
    dm = Model.load(draft) if draft else None
    tc = Context(tm, n_slots=n_slots, n_ctx=n_ctx)
    dc = Context(dm, n_slots=n_slots, n_ctx=n_ctx) if dm else None
    dec = SpecDecoder(tc, dc)
    yield dec
    dec.close()
    for obj in (tc, dc, tm, dm):
        if obj is not None:
            obj.close()


@pytest.fixture()
def dec(pair: tuple[Path, Path, Path]) -> Iterator[SpecDecoder]:
    yield from open_decoder(pair[0], pair[1])


def target_only_greedy(ctx: Context, prompt: list[int], n: int) -> list[int]:
    logits = ctx.decode(0, prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = ctx.decode(0, [out[-1]])
    return out


@pytest.fixture(scope="module")
def greedy_reference(pair: tuple[Path, Path, Path]) -> list[int]:
    with Model.load(pair[0]) as m, Context(m, n_ctx=256) as ctx:
        return target_only_greedy(ctx, PROMPT, 80)


@pytest.mark.parametrize("n_max", list(range(1, 17)))
def test_greedy_speculation_equals_target_only(dec: SpecDecoder, greedy_reference: list[int],
                                               n_max: int) -> None:
    out = dec.generate(0, PROMPT, 80, GREEDY, SpecParams(n_max=n_max))
    assert out == greedy_reference
    c = dec.counters(0)
    assert 0 < c.n_accepted < c.n_drafted  # the perturbed draft is right only sometimes
    assert c.n_draft_prefill == len(PROMPT)
    assert sum(c.accepted_at) == c.n_accepted and sum(c.drafted_at) == c.n_drafted
    assert all(c.drafted_at[i] == 0 for i in range(n_max, 16))
    assert dec.tokens(0) == PROMPT + out


def test_identical_draft_accepts_everything(pair: tuple[Path, Path, Path],
                                            greedy_reference: list[int]) -> None:
    for dec in open_decoder(pair[0], pair[2]):
        out = dec.generate(0, PROMPT, 80, GREEDY, SpecParams(n_max=4))
        c = dec.counters(0)
        assert out == greedy_reference
        # every step yields its proposals plus one token: 79 tokens after the prefill
        assert c.n_steps == math.ceil((80 - 1) / 5) == 16
        assert c.n_accepted == c.n_drafted == 79 - 16


def test_no_draft_decodes_target_only(pair: tuple[Path, Path, Path],
                                      greedy_reference: list[int]) -> None:
    for dec in open_decoder(pair[0], None):
        assert dec.generate(0, PROMPT, 80, GREEDY, SpecParams(n_max=8)) == greedy_reference
        assert dec.counters(0).n_drafted == 0


def test_p_min_and_n_min(dec: SpecDecoder, greedy_reference: list[int]) -> None:
    out = dec.generate(0, PROMPT, 40, GREEDY, SpecParams(n_max=6, n_min=0, p_min=1.0))
    assert out == greedy_reference[:40]
    assert dec.counters(0).n_drafted == 0  # no draft is ever 100 % sure
    dec.clear(1)
    out = dec.generate(1, PROMPT, 40, GREEDY, SpecParams(n_max=6, n_min=2, p_min=1.0))
    c = dec.counters(1)
    assert out == greedy_reference[:40]
    # two proposals every step, one in a final step limited to two new tokens
    assert c.drafted_at[0] == c.n_steps
    assert c.drafted_at[1] in (c.n_steps, c.n_steps - 1)
    assert c.drafted_at[2] == 0


def test_max_new_bounds_a_step(dec: SpecDecoder) -> None:
    dec.prefill(0, PROMPT, GREEDY)
    for max_new in (1, 2, 3):
        assert 1 <= len(dec.step(0, GREEDY, SpecParams(n_max=16), max_new=max_new)) <= max_new


def test_commit_and_truncate_keep_both_caches_aligned(dec: SpecDecoder,
                                                      greedy_reference: list[int]) -> None:
    out = dec.generate(0, PROMPT, 20, GREEDY, SpecParams(n_max=4))
    dec.commit(0)
    assert dec.tokens(0) == PROMPT + out
    assert dec.target.tokens(0) == PROMPT + out
    assert dec.draft.tokens(0) == PROMPT + out  # the draft followed the commit
    dec.truncate(0, len(PROMPT) + 5)
    assert dec.draft.tokens(0) == PROMPT + out[:5]
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        dec.prefill(0, [], GREEDY)
    dec.truncate(0, len(PROMPT) + 4)  # re-decode the last kept token to get its logits
    first = dec.prefill(0, [out[4]], GREEDY)
    assert first == greedy_reference[5]
    more = [first] + dec.step(0, GREEDY, SpecParams(n_max=4), max_new=10)
    assert more == greedy_reference[5:5 + len(more)]


def test_same_seed_same_tokens(dec: SpecDecoder) -> None:
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02)
    runs = []
    for slot in (0, 1, 0):
        dec.clear(slot)
        dec.seed(slot, 1234)
        runs.append(dec.generate(slot, PROMPT, 30, sp, SpecParams(n_max=4)))
    assert runs[0] == runs[1] == runs[2]
    dec.clear(0)
    dec.seed(0, 99)
    assert dec.generate(0, PROMPT, 30, sp, SpecParams(n_max=4)) != runs[0]


def step_together(dec: SpecDecoder, prompts: list[list[int]], sp: SamplingParams,
                  specs: list[SpecParams], n_new: int,
                  seed0: int) -> tuple[list[list[int]], set[Drafter]]:
    """Slot i (seeded seed0 + i) prefilled with prompts[i], then every slot still short of
    n_new tokens stepping in one batched pass with specs[i]: each slot's tokens, and the
    drafters that proposed."""
    outs: list[list[int]] = []
    for slot, p in enumerate(prompts):
        dec.seed(slot, seed0 + slot)
        outs.append([dec.prefill(slot, p, sp)])
    kinds: set[Drafter] = set()
    while any(len(o) < n_new for o in outs):
        live = [s for s in range(len(outs)) if len(outs[s]) < n_new]
        res = dec.step_batch(live, [sp] * len(live), [specs[s] for s in live],
                             [n_new - len(outs[s]) for s in live])
        for s, r in zip(live, res, strict=True):
            outs[s] += r.tokens
            kinds.add(r.drafter)
    return outs, kinds


def exact_dist(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """temperature then top-k (the test uses no top-p / min-p), as a dense vector."""
    z = logits.astype(np.float64) / sp.temperature
    keep = np.argsort(-z, kind="stable")[: sp.top_k]
    p = np.zeros_like(z)
    p[keep] = np.exp(z[keep] - z[keep].max())
    return p / p.sum()


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square, Wilson-Hilferty approximation of the upper tail."""
    mask = expected >= 5
    obs = np.append(observed[mask], observed[~mask].sum())
    exp = np.append(expected[mask], expected[~mask].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    x = float(((obs - exp) ** 2 / exp).sum())
    k = len(obs) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampling_distribution_matches_target(pair: tuple[Path, Path, Path]) -> None:
    """Pairs (t1, t2): t1 comes from prefill, t2 from a speculative step with drafts
    at position 1 (accepted or resampled). Their joint law must be the target's."""
    sp = SamplingParams(temperature=1.0, top_k=6)
    spec = SpecParams(n_max=3)
    runs = 3000
    with Model.load(pair[0]) as m, Context(m, n_ctx=64) as ctx:
        p1 = exact_dist(ctx.decode(0, PROMPT), sp)
        cand = np.flatnonzero(p1)
        cond = {}
        for t1 in cand:
            ctx.truncate(0, len(PROMPT))
            cond[int(t1)] = exact_dist(ctx.decode(0, [int(t1)]), sp)
    expected = np.array([p1[a] * cond[a][b] for a in cond for b in range(300)]) * runs
    index = {(a, b): i for i, (a, b) in enumerate((a, b) for a in cond for b in range(300))}

    def joint(draft_path: Path | None, spec_params: SpecParams) -> np.ndarray:
        counts = np.zeros(len(index))
        for dec in open_decoder(pair[0], draft_path, n_slots=1, n_ctx=64):
            for seed in range(runs):
                dec.clear(0)
                dec.seed(0, seed)
                t1 = dec.prefill(0, PROMPT, sp)
                t2 = dec.step(0, sp, spec_params, max_new=2)[0]
                counts[index[(t1, t2)]] += 1
            drafted = dec.counters(0).n_drafted
            accepted = dec.counters(0).n_accepted
        if spec_params.n_max:
            assert drafted == runs and 0.2 * runs < accepted < runs  # both branches exercised
        return counts

    assert chi2_pvalue(joint(pair[1], spec), expected) > 1e-3
    assert chi2_pvalue(joint(None, NO_SPEC), expected) > 1e-3
    # the test can fail: the draft's own distribution is measurably different
    with Model.load(pair[1]) as dm, Context(dm, n_ctx=64) as dctx:
        q1 = exact_dist(dctx.decode(0, PROMPT), sp)
    wrong = np.array([q1[a] for a in cond for _ in range(300)])
    assert chi2_pvalue(expected * wrong / p1[[a for a in cond for _ in range(300)]],
                       expected) < 1e-6


def test_draft_state_roundtrip(dec: SpecDecoder) -> None:
    sp = SamplingParams(temperature=0.8, top_k=30)
    spec = SpecParams(n_max=4)
    dec.seed(0, 7)
    dec.generate(0, PROMPT, 25, sp, spec)
    dec.commit(0)
    target_state = dec.target.get_state(0)
    draft_state = dec.draft_state(0)
    before = dec.counters(0)
    control = dec.generate(0, [11, 12], 20, sp, spec)
    control_counters = dec.counters(0) - before
    # restore into the other slot and continue: same tokens, same drafting work
    dec.target.set_state(1, target_state)
    dec.set_draft_state(1, draft_state)
    assert dec.counters(1) == before
    got = dec.generate(1, [11, 12], 20, sp, spec)
    assert got == control
    assert dec.counters(1) - before == control_counters
    assert control_counters.n_draft_prefill == 2


def test_draft_restore_policies(dec: SpecDecoder) -> None:
    spec = SpecParams(n_max=4)
    dec.generate(0, PROMPT, 30, GREEDY, spec)
    dec.commit(0)
    n = dec.n_tokens(0)
    state = dec.target.get_state(0)
    ref_before = dec.counters(0)
    ref = dec.generate(0, [11, 12, 13], 20, GREEDY, spec)
    ref_c = dec.counters(0) - ref_before
    for policy_offset in (0, n):  # reprefill, empty
        dec.clear(1)
        dec.target.set_state(1, state)
        dec.draft_reset(1, policy_offset)
        before = dec.counters(1)
        assert dec.generate(1, [11, 12, 13], 20, GREEDY, spec) == ref
        c = dec.counters(1) - before
        if policy_offset == 0:
            assert c.n_draft_prefill == n + 3
            assert (c.n_drafted, c.n_accepted) == (ref_c.n_drafted, ref_c.n_accepted)
        else:
            assert c.n_draft_prefill == 3
            assert dec.draft_offset(1) == n


def test_bad_draft_state_leaves_draft_empty(dec: SpecDecoder) -> None:
    dec.generate(0, PROMPT, 10, GREEDY, SpecParams(n_max=3))
    dec.commit(0)
    good = bytes(dec.draft_state(0))
    dec.target.set_state(1, dec.target.get_state(0))
    bad = {
        "truncated": good[:-4],
        "magic": b"XXXX" + good[4:],
        "version": good[:4] + (9).to_bytes(4, "little") + good[8:],
        "short": good[:10],
    }
    for name, data in bad.items():
        with pytest.raises(BadStateError):
            dec.set_draft_state(1, data)
        assert dec.draft_n_tokens(1) == 0, name
    # a draft state of other tokens is refused
    dec.clear(1)
    dec.prefill(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], GREEDY)
    dec.commit(1)
    with pytest.raises(BadStateError, match="not the target's tokens"):
        dec.set_draft_state(1, good)
    assert dec.draft_n_tokens(1) == 0
    assert dec.set_draft_state(0, good) == len(good)


@pytest.mark.parametrize("sampling,spec,message", [
    (GREEDY, SpecParams(n_max=17), "n_max 17 outside 0..16"),
    (GREEDY, SpecParams(n_max=-1), "n_max -1"),
    (GREEDY, SpecParams(n_max=2, n_min=3), "n_min 3"),
    (GREEDY, SpecParams(p_min=1.5), "p_min 1.5 outside"),
    (GREEDY, SpecParams(p_min=-0.1), "p_min -0.1 outside"),
    (SamplingParams(temperature=-1), NO_SPEC, "temperature -1"),
    (SamplingParams(temperature=float("nan")), NO_SPEC, "temperature nan"),
    (SamplingParams(top_p=0.0), NO_SPEC, "top_p 0 outside"),
    (SamplingParams(min_p=1.0), NO_SPEC, "min_p 1 outside"),
    (SamplingParams(top_k=-2), NO_SPEC, "top_k -2"),
])
def test_bad_parameters_fail_before_decoding(dec: SpecDecoder, sampling: SamplingParams,
                                             spec: SpecParams, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        dec.check(sampling, spec)
    dec.prefill(0, PROMPT, GREEDY)
    n = dec.target.n_tokens(0)
    with pytest.raises(InvalidArgumentError, match=message):
        dec.step(0, sampling, spec)
    assert dec.target.n_tokens(0) == n


def test_step_needs_a_prefill(dec: SpecDecoder) -> None:
    with pytest.raises(BadStateError, match="no pending token"):
        dec.step(0, GREEDY, SpecParams(n_max=2))


def test_vocabulary_mismatch_is_refused(tmp_path: Path, pair: tuple[Path, Path, Path]) -> None:
    other = tmp_path / "other.gguf"
    write_model(other, Shape(n_vocab=310, n_embd=32, n_layer=1, n_head=2, n_head_kv=2, n_ff=48))
    other_tokens = tmp_path / "other_tokens.gguf"
    write_model(other_tokens, Shape(n_vocab=300, n_embd=32, n_layer=1, n_head=2, n_head_kv=2,
                                    n_ff=48), seed=99)
    for path, msg in ((other, "310 tokens"), (other_tokens, "vocabulary")):
        with Model.load(pair[0]) as tm, Model.load(path) as dm, \
                Context(tm, n_ctx=32) as tc, Context(dm, n_ctx=32) as dc:
            with pytest.raises(InvalidArgumentError, match=msg):
                SpecDecoder(tc, dc)


def test_context_shape_mismatch_is_refused(pair: tuple[Path, Path, Path]) -> None:
    with Model.load(pair[0]) as tm, Model.load(pair[1]) as dm, \
            Context(tm, n_ctx=32) as tc, Context(dm, n_ctx=64) as dc:
        with pytest.raises(InvalidArgumentError, match="must match"):
            SpecDecoder(tc, dc)


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=0.9999),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=5.0, top_k=50, top_p=1e-6, min_p=0.5),
])
def test_filters_that_keep_one_token_are_greedy(dec: SpecDecoder, greedy_reference: list[int],
                                                sampling: SamplingParams) -> None:
    dec.seed(0, 5)
    assert dec.generate(0, PROMPT, 40, sampling, SpecParams(n_max=4)) == greedy_reference[:40]


def test_step_multi_equals_separate_steps(pair: tuple[Path, Path, Path]) -> None:
    """Target-only steps of several slots in one pass: the same tokens, RNG draws and
    counters as stepping each slot alone (greedy and sampled slots mixed)."""
    sps = [GREEDY, SamplingParams(temperature=0.9, top_k=30), GREEDY,
           SamplingParams(temperature=0.7, min_p=0.05)]
    prompts = [PROMPT, [9, 8, 7], PROMPT[:3], [100, 200, 250, 5]]

    def run(multi: bool) -> tuple[list[list[int]], list[object]]:
        for dec in open_decoder(pair[0], pair[1], n_slots=4, n_ctx=64):
            outs = []
            for s, p in enumerate(prompts):
                dec.seed(s, 40 + s)
                outs.append([dec.prefill(s, p, sps[s], with_draft=False)])
            for _ in range(12):
                if multi:
                    toks = dec.step_multi([3, 1, 0, 2], [sps[3], sps[1], sps[0], sps[2]])
                    for s, t in zip([3, 1, 0, 2], toks, strict=True):
                        outs[s].append(t)
                else:
                    for s in range(4):
                        outs[s] += dec.step(s, sps[s], NO_SPEC)
            for s in range(4):
                dec.commit(s)
            return outs, [dec.counters(s) for s in range(4)] + [dec.tokens(s) for s in range(4)]
        raise AssertionError("unreachable")

    assert run(True) == run(False)


def test_step_multi_validation(dec: SpecDecoder) -> None:
    with pytest.raises(BadStateError, match="no pending token"):
        dec.step_multi([0, 1], [GREEDY, GREEDY])
    dec.prefill(0, PROMPT, GREEDY)
    dec.prefill(1, PROMPT, GREEDY)
    with pytest.raises(InvalidArgumentError, match="slot 0 appears twice"):
        dec.step_multi([0, 0], [GREEDY, GREEDY])
    with pytest.raises(InvalidArgumentError, match="top_p 0 outside"):
        dec.step_multi([0, 1], [GREEDY, SamplingParams(top_p=0.0)])
    assert dec.n_tokens(0) == dec.n_tokens(1) == len(PROMPT) + 1  # nothing decoded


LONG_PROMPT = [(37 * k + 11) % 290 + 1 for k in range(60)]


def test_chunked_draft_catch_up_matches_one_sync(dec: SpecDecoder) -> None:
    """A draft that re-prefills a restored context in bounded pieces ends with the
    same state, bit for bit, as one draft_sync, and counts the same prefill."""
    spec = SpecParams(n_max=4)
    for slot in (0, 1):
        dec.seed(slot, 5)
        dec.generate(slot, LONG_PROMPT, 10, GREEDY, spec)
        dec.commit(slot)
        dec.draft_reset(slot, 0)
    n = dec.n_tokens(0)
    assert n == len(LONG_PROMPT) + 10
    before = dec.counters(0)
    assert dec.draft_sync(1) == n
    steps = []
    while True:
        done, left = dec.draft_catch_up(0, 16)
        steps.append((done, left))
        if not left:
            break
    assert steps == [(16, n - 16), (16, n - 32), (16, n - 48), (16, n - 64), (n - 64, 0)]
    assert dec.draft_catch_up(0, 16) == (0, 0)
    assert dec.draft_n_tokens(0) == n
    assert (dec.counters(0) - before).n_draft_prefill == n
    assert bytes(dec.draft_state(0)) == bytes(dec.draft_state(1))
    assert dec.generate(0, [4], 12, GREEDY, spec) == dec.generate(1, [4], 12, GREEDY, spec)
    with pytest.raises(InvalidArgumentError):
        dec.draft_catch_up(0, 0)


def test_prefill_chunks_match_one_prefill(dec: SpecDecoder) -> None:
    """Prompt chunks (target and draft, no sampling) then the last piece give the
    same state and tokens as one prefill of the whole prompt."""
    spec = SpecParams(n_max=4)
    dec.seed(0, 9)
    dec.seed(1, 9)
    first = dec.prefill(1, LONG_PROMPT, GREEDY)
    for i in range(0, 48, 16):
        dec.prefill_chunk(0, LONG_PROMPT[i:i + 16])
        assert (dec.n_tokens(0), dec.draft_n_tokens(0)) == (i + 16, i + 16)
    assert dec.prefill(0, LONG_PROMPT[48:], GREEDY) == first
    assert (dec.counters(0).n_draft_prefill, dec.counters(1).n_draft_prefill) == (60, 60)
    dec.commit(0)
    dec.commit(1)
    assert bytes(dec.target.get_state(0)) == bytes(dec.target.get_state(1))
    assert bytes(dec.draft_state(0)) == bytes(dec.draft_state(1))
    assert dec.generate(0, [4], 12, GREEDY, spec) == dec.generate(1, [4], 12, GREEDY, spec)
    # a pending token rides along with the next chunk and counts as generated
    dec.clear(0)
    c0 = dec.counters(0).n_draft_prefill
    dec.prefill(0, LONG_PROMPT[:5], GREEDY)
    dec.prefill_chunk(0, LONG_PROMPT[5:9])
    assert dec.n_tokens(0) == dec.draft_n_tokens(0) == 10
    assert dec.counters(0).n_draft_prefill - c0 == 5 + 4
    with pytest.raises(InvalidArgumentError):
        dec.prefill_chunk(0, [])
    with pytest.raises(ContextFullError):
        dec.prefill_chunk(0, [1] * 300)


def test_whole_slot_state_in_parts(dec: SpecDecoder) -> None:
    """slot_state commits the pending token and gives both states apart; set_slot_state
    loads them into another slot, which then continues exactly like the first."""
    spec = SpecParams(n_max=4)
    sp = SamplingParams(temperature=0.8, top_k=30)
    dec.seed(0, 3)
    dec.generate(0, PROMPT, 15, sp, spec)
    n = dec.n_tokens(0)
    target, draft = dec.slot_state(0)
    assert draft is not None
    assert dec.target.n_tokens(0) == n  # the pending token went into the KV
    assert bytes(target) == bytes(dec.target.get_state(0))
    assert bytes(draft) == bytes(dec.draft_state(0))
    header, toks = bytes(target[:32]), bytes(target[32:32 + 4 * n])
    parts = (header, toks, target[32 + 4 * n:])
    assert dec.set_slot_state(1, parts, draft, 0) == (True, "")
    assert (dec.n_tokens(1), dec.draft_n_tokens(1)) == (n, dec.draft_n_tokens(0))
    assert dec.counters(1) == dec.counters(0)
    assert dec.generate(1, [9], 10, sp, spec) == dec.generate(0, [9], 10, sp, spec)
    # a refused draft state: the target is loaded, the draft starts empty at the offset
    bad = bytearray(draft)
    bad[0] ^= 0xFF
    loaded, why = dec.set_slot_state(1, parts, bad, n)
    assert not loaded and "magic" in why
    assert (dec.n_tokens(1), dec.draft_n_tokens(1), dec.draft_offset(1)) == (n, 0, n)
    # no draft state: an empty draft from the given offset, nothing refused
    assert dec.set_slot_state(1, parts, None, 0) == (False, "")
    assert (dec.n_tokens(1), dec.draft_n_tokens(1), dec.draft_offset(1)) == (n, 0, 0)
    # a refused target or offset leaves the slot empty
    with pytest.raises(BadStateError):
        dec.set_slot_state(1, (header, toks[:-4], parts[2]), draft, 0)
    assert (dec.n_tokens(1), dec.draft_n_tokens(1)) == (0, 0)
    with pytest.raises(InvalidArgumentError, match="draft offset"):
        dec.set_slot_state(1, parts, None, n + 1)
    assert dec.n_tokens(1) == 0
