"""Speculative decoding with the feature head: greedy output identical to target-only
for every n_max, the head level with the target after steps, truncations and
restores, batched slots equal to separate ones, and sampling that keeps the target's
law (chi-square)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, Model
from inference_svc.core.head import Head
from inference_svc.core.speculative import (
    Drafter,
    SamplingParams,
    SpecDecoder,
    SpecParams,
    lookup_lengths,
)
from tests.factory import write_model
from tests.headkit import write_head
from tests.test_speculative import TARGET as SMALL
from tests.test_speculative import chi2_pvalue, exact_dist, step_together

pytestmark = pytest.mark.native

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "models" / "target.gguf"
GREEDY = SamplingParams()
# the small target repeats token 121 after this prompt: the echo head's drafts are
# accepted; after SEVENS it repeats now and then: accepted there, rejected elsewhere
REPEAT = [262] * 10
SEVENS = [7] * 12
PROMPT = [5, 17, 250, 3, 99, 42, 7]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("headspec")
    small = d / "small.gguf"
    write_model(small, SMALL, seed=3)
    return {
        "small": small,
        "echo": write_head(d / "echo.gguf", small, k=0, echo=True),
        "random": write_head(d / "random.gguf", small, k=200, n_ff=64, seed=5,
                             token_ids=np.random.default_rng(4).permutation(300)[:200]),
        "toy_head": write_head(d / "toy_head.gguf", TOY, k=1024, n_ff=128, seed=6),
    }


def open_decoder(target: Path, head: Path | None, n_slots: int = 2,
                 n_ctx: int = 256) -> Iterator[SpecDecoder]:
    with Model.load(target) as tm:
        hm = Head(head, tm) if head is not None else None
        tc = Context(tm, n_slots=n_slots, n_ctx=n_ctx, n_threads=2)
        hc = Context(hm, n_slots=n_slots, n_ctx=n_ctx, n_threads=1) if hm else None
        dec = SpecDecoder(tc, None, hc)
        try:
            yield dec
        finally:
            dec.close()
            tc.close()
            if hc is not None:
                hc.close()
            if hm is not None:
                hm.close()


def reference(target: Path, prompt: list[int], n: int) -> list[int]:
    for dec in open_decoder(target, None):
        return dec.generate(0, prompt, n, GREEDY)
    raise AssertionError


def run(dec: SpecDecoder, slot: int, prompt: list[int], n: int, sp: SamplingParams,
        spec: SpecParams) -> tuple[list[int], dict[Drafter, list[int]]]:
    out = [dec.prefill(slot, prompt, sp)]
    by = {d: [0, 0] for d in Drafter}
    while len(out) < n:
        r = dec.step_batch([slot], [sp], [spec], [n - len(out)])[0]
        by[r.drafter][0] += r.drafted
        by[r.drafter][1] += len(r.tokens) - 1
        out += r.tokens
        # after every step the head is level: pairs 0..n-2 of the KV's n tokens
        n_kv = dec.n_tokens(slot) - 1
        assert dec.head_status(slot) == (n_kv - 1, True)
    return out, by


@pytest.mark.parametrize("n_max", list(range(1, 17)))
def test_greedy_head_equals_target_only(files: dict[str, Path], n_max: int) -> None:
    ref = reference(files["small"], SEVENS, 60)
    for dec in open_decoder(files["small"], files["echo"]):
        out, by = run(dec, 0, SEVENS, 60, GREEDY, SpecParams(n_max=0, head_n_max=n_max))
        assert out == ref
        drafted, accepted = by[Drafter.HEAD]
        assert 0 < accepted < drafted  # the echo head is right where the target repeats
        assert by[Drafter.MODEL] == by[Drafter.LOOKUP] == [0, 0]
        assert dec.tokens(0) == SEVENS + out


@pytest.mark.parametrize("n_max", list(range(1, 17)))
def test_greedy_random_head_on_the_bundled_target(files: dict[str, Path], n_max: int) -> None:
    ref = reference(TOY, PROMPT, 40)
    for dec in open_decoder(TOY, files["toy_head"]):
        out, by = run(dec, 1, PROMPT, 40, GREEDY, SpecParams(n_max=0, head_n_max=n_max))
        assert out == ref
        assert by[Drafter.HEAD][0] >= 39 // (n_max + 1)  # the head drafted every step


def test_head_and_lookup_share_a_request(files: dict[str, Path]) -> None:
    """Where lookup finds a repeat it drafts and the head sits out; the head stays level."""
    prompt = PROMPT * 3
    ref = reference(files["small"], prompt, 60)
    for dec in open_decoder(files["small"], files["random"]):
        out, by = run(dec, 0, prompt, 60, GREEDY,
                      SpecParams(n_max=0, head_n_max=4, lookup_k=lookup_lengths(4, 3)))
        assert out == ref
        assert by[Drafter.LOOKUP][0] > 0 and by[Drafter.HEAD][0] > 0


def test_truncate_and_restore_keep_the_head_exact(files: dict[str, Path]) -> None:
    """A slot cut back to a prefix and continued holds the head KV (state bytes) of a
    slot that only ever saw that prefix and continuation; a slot restored without the
    head's pairs does not draft with the head (its output stays the target's) until
    it is cleared."""
    spec = SpecParams(n_max=0, head_n_max=3)
    for dec in open_decoder(files["small"], files["echo"], n_slots=3):
        out, _ = run(dec, 0, REPEAT, 30, GREEDY, spec)
        dec.truncate(0, 12)  # into the KV: 11 kept, the 12th pending
        assert dec.tokens(0) == (REPEAT + out)[:12] and dec.head_status(0) == (11, False)
        cont, _ = run(dec, 0, [9, 8, 7], 20, GREEDY, spec)
        fresh, _ = run(dec, 1, (REPEAT + out)[:12] + [9, 8, 7], 20, GREEDY, spec)
        assert cont == fresh
        dec.commit(0)
        dec.commit(1)
        assert bytes(dec.head.get_state(0)) == bytes(dec.head.get_state(1))
        # a restore without the head's state: the head is off for the slot
        tstate = dec.target.get_state(0)
        hdr, n = bytes(tstate[:32]), dec.n_tokens(0)
        loaded, _ = dec.set_slot_state(2, (hdr, bytes(tstate[32:32 + 4 * n]),
                                           bytes(tstate[32 + 4 * n:])), None, 0)
        assert not loaded and dec.head_status(2) == (0, False)
        ref_more, _ = run(dec, 1, [4], 10, GREEDY, SpecParams(n_max=0))
        out2 = [dec.prefill(2, [4], GREEDY)]
        while len(out2) < 10:
            r = dec.step_batch([2], [GREEDY], [spec], [10 - len(out2)])[0]
            assert r.drafter == Drafter.NONE
            out2 += r.tokens
        assert out2 == ref_more
        dec.clear(2)
        assert dec.head_status(2) == (0, False)
        run(dec, 2, REPEAT, 10, GREEDY, spec)  # asserts the head is level again


def test_batched_head_equals_separate_steps(files: dict[str, Path]) -> None:
    """Two slots stepping together (sampled, head in one, lookup in the other) give the
    tokens each gives alone."""
    sp = SamplingParams(temperature=0.9, top_k=20)
    prompts = [REPEAT, PROMPT * 2]
    specs = [SpecParams(n_max=0, head_n_max=3),
             SpecParams(n_max=0, head_n_max=2, lookup_k=lookup_lengths(3))]
    alone = []
    for dec in open_decoder(files["small"], files["echo"]):
        for slot, p in enumerate(prompts):
            dec.seed(slot, 5 + slot)
            alone.append(run(dec, slot, p, 40, sp, specs[slot])[0])
    for dec in open_decoder(files["small"], files["echo"]):
        outs, kinds = step_together(dec, prompts, sp, specs, 40, seed0=5)
        assert outs == alone
        assert {Drafter.HEAD, Drafter.LOOKUP} <= kinds


def test_head_sampling_distribution_matches_target(files: dict[str, Path]) -> None:
    """Pairs (t1, t2): t1 from prefill, t2 from a step whose first proposal is the
    head's (drawn from its own law q over its token_ids, accepted with min(1, p/q),
    else resampled from the residual). The joint law is the target's."""
    sp = SamplingParams(temperature=1.0, top_k=6)
    runs = 3000
    with Model.load(files["small"]) as m, Context(m, n_ctx=64) as ctx:
        p1 = exact_dist(ctx.decode(0, REPEAT), sp)
        cond = {}
        for t1 in np.flatnonzero(p1):
            ctx.truncate(0, len(REPEAT))
            cond[int(t1)] = exact_dist(ctx.decode(0, [int(t1)]), sp)
    pairs = [(a, b) for a in cond for b in range(300)]
    expected = np.array([p1[a] * cond[a][b] for a, b in pairs]) * runs
    index = {ab: i for i, ab in enumerate(pairs)}
    counts = np.zeros(len(index))
    spec = SpecParams(n_max=0, head_n_max=1)
    for dec in open_decoder(files["small"], files["echo"], n_slots=1, n_ctx=64):
        for seed in range(runs):
            dec.clear(0)
            dec.seed(0, seed)
            t1 = dec.prefill(0, REPEAT, sp)
            r = dec.step_batch([0], [sp], [spec], [2])[0]
            assert (r.drafter, r.drafted) == (Drafter.HEAD, 1)
            counts[index[(t1, r.tokens[0])]] += 1
        c = dec.counters(0)
        assert c.n_drafted == runs and 0.05 * runs < c.n_accepted < runs  # both branches
    assert chi2_pvalue(counts, expected) > 1e-3
    # the test can fail: the law of the first token alone, repeated, is another one
    wrong = np.array([p1[a] * p1[b] if b < len(p1) else 0.0 for a, b in pairs]) * runs
    assert chi2_pvalue(wrong, expected) < 1e-6


SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINED = ROOT / "models" / "smollm2-head.gguf"  # the trainer's head, once committed


@pytest.fixture(scope="module")
def smollm2_heads(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    assert SMOLLM2.exists(), f"{SMOLLM2} is missing: `make fetch-models`"
    rnd = write_head(tmp_path_factory.mktemp("smol") / "random.gguf", SMOLLM2, k=4096,
                     n_ff=512, seed=9, matrix_type="q8_0",
                     token_ids=np.random.default_rng(1).permutation(49152)[:4096])
    return [rnd] + ([TRAINED] if TRAINED.exists() else [])


def smollm2_prompt() -> list[int]:
    with Model.load(SMOLLM2) as m:
        return m.tokenizer.encode("<|im_start|>user\nWrite a short poem about the first snow "
                                  "of winter.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("n_max", list(range(1, 17)))
def test_smollm2_greedy_with_heads_equals_target_only(smollm2_heads: list[Path],
                                                      n_max: int) -> None:
    """On SmolLM2 with a random head (and the trained one when it is there), several
    slots stepped in one target pass: the greedy output is the target-only one."""
    prompt = smollm2_prompt()
    ref = reference(SMOLLM2, prompt, 24)
    for head in smollm2_heads:
        for dec in open_decoder(SMOLLM2, head, n_slots=2, n_ctx=128):
            outs = [[dec.prefill(s, prompt, GREEDY)] for s in (0, 1)]
            spec = SpecParams(n_max=0, head_n_max=n_max)
            while len(outs[0]) < 24:
                left = 24 - len(outs[0])
                res = dec.step_batch([0, 1], [GREEDY] * 2, [spec] * 2, [left] * 2)
                for s, r in enumerate(res):
                    assert r.drafter == (Drafter.HEAD if left > 1 else Drafter.NONE)
                    outs[s] += r.tokens
            assert outs == [ref, ref]


def test_head_draft_state_roundtrip_and_refusals(files: dict[str, Path]) -> None:
    """The draft state (WSSP version 2) carries the head's pairs and h_{n-1}: restored
    into another slot, the next turn drafts, accepts and counts exactly as the original
    slot; a state whose head part is corrupt is refused and leaves the head off."""
    spec = SpecParams(n_max=0, head_n_max=3)
    for dec in open_decoder(files["small"], files["echo"], n_slots=3):
        run(dec, 0, SEVENS, 20, GREEDY, spec)
        tstate, dstate = dec.slot_state(0)
        assert dstate is not None and bytes(dstate[4:8]) == (2).to_bytes(4, "little")
        n = dec.n_tokens(0)
        parts = (bytes(tstate[:32]), bytes(tstate[32:32 + 4 * n]), bytes(tstate[32 + 4 * n:]))
        assert dec.set_slot_state(1, parts, dstate, 0) == (True, "")
        assert dec.head_status(1) == (n - 1, True) and dec.counters(1) == dec.counters(0)
        a, _ = run(dec, 0, [9, 9], 25, GREEDY, spec)
        b, _ = run(dec, 1, [9, 9], 25, GREEDY, spec)
        assert a == b and dec.counters(0) == dec.counters(1)
        bad = bytearray(dstate)
        bad[336 + 32:336 + 36] = b"\x00\x00\xc0\x7f"  # h[0] = NaN
        loaded, why = dec.set_slot_state(2, parts, bytes(bad), 0)
        assert not loaded and "not finite" in why and dec.head_status(2) == (0, False)
        cut = bytes(dstate[:-4])
        loaded, why = dec.set_slot_state(2, parts, cut, 0)
        assert not loaded and "do not make its" in why and dec.head_status(2) == (0, False)
