"""The draft length of each speculative step, chosen from the measured acceptance.

A draft that proposes k tokens costs its own k decodes plus k more tokens in the
target's verification pass; it pays only when enough of them are accepted. With a
per-token acceptance probability a, a step that drafts k tokens yields on average
E(k) = 1 + a + ... + a^k tokens for a cost of 1 + k * cost target steps (`cost`:
one drafted token's price in target decode steps). Each step drafts the k in
0..n_max that maximises E(k) / (1 + k * cost); k = 0 when no draft length beats
plain decoding.

The acceptance estimate is a moving average over the proposals of recent steps
(each step weighs `decay` times the one before it): a proposal accepted is a
success, the first one rejected a failure, the ones after it are never tried; a
step whose draft declined to propose (its confidence below p_min) is a failure.
While the estimate says k = 0 the slot decodes target-only, its draft idle (a
lagging draft costs nothing until it drafts again), and every `interval` steps
one token is drafted as a probe, so a change of text that makes the draft useful
again is noticed; each probe that leaves the estimate at k = 0 doubles the
interval up to `max_interval`. Only the outcomes of steps drive the choice (no
clock), so a seeded request samples the same tokens every time.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_TRIALS = 4.0  # weight of the starting estimate, in proposals
FIRST_INTERVAL = 8  # target-only steps before the first probe
MAX_INTERVAL = 64


@dataclass
class DraftLength:
    n_max: int
    cost: float = 0.3
    decay: float = 0.8
    accepted: float = 0.0  # moving sums of proposals accepted and tried
    tried: float = 0.0
    idle: int = 0  # target-only steps since the last drafted one
    interval: int = FIRST_INTERVAL
    # the weight of a step whose drafter declined (below p_min) as a failed trial: a
    # draft model's decline cost a draft decode (1, a rejected proposal's); the head's
    # its small forward pass only (HEAD_DECLINE), so its confident drafts are judged
    # mostly by their own acceptance
    decline: float = 1.0

    @classmethod
    def start(cls, n_max: int, cost: float, prior: float) -> DraftLength:
        """A controller whose estimate starts at `prior` acceptance."""
        return cls(n_max, cost, accepted=prior * PRIOR_TRIALS, tried=PRIOR_TRIALS)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0

    def best(self) -> int:
        """The draft length with the highest expected tokens per unit of cost."""
        a = self.acceptance
        best_k, best_rate = 0, 1.0
        expected, power = 1.0, 1.0
        for k in range(1, self.n_max + 1):
            power *= a
            expected += power
            rate = expected / (1.0 + k * self.cost)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def next(self) -> int:
        """The next step's draft length (no state changes: `observe` moves on)."""
        k = self.best()
        if k == 0 and self.n_max > 0 and self.idle + 1 >= self.interval:
            return 1  # a probe
        return k

    def observe(self, asked: int, drafted: int, accepted: int) -> None:
        """A step asked for `asked` proposals (`next`), the draft made `drafted` (fewer
        when its confidence fell below p_min) and the target accepted `accepted`."""
        if asked == 0:
            self.idle += 1
            return
        probe = self.best() == 0
        self.idle = 0
        # a draft that declined to propose (below p_min) cost a draft decode and gained
        # nothing: a failed trial of weight `decline`, a rejected proposal one of 1
        trials = accepted + (1.0 if accepted < drafted else self.decline if drafted == 0
                             else 0.0)
        self.accepted = self.decay * self.accepted + accepted
        self.tried = self.decay * self.tried + trials
        if self.best() > 0:
            self.interval = FIRST_INTERVAL
        elif probe:
            self.interval = min(2 * self.interval, MAX_INTERVAL)


# The lookup drafter's acceptance depends mostly on the length m of the repeat it
# continues: one estimate per band of m, the bands starting at these lengths, each
# starting from its own prior acceptance per proposal.
LOOKUP_BANDS = (1, 2, 3, 4, 8)
# the head's decline (DraftLength.decline): its forward pass is about a quarter of a
# verified token's price
HEAD_DECLINE = 0.25
LOOKUP_PRIORS = (0.2, 0.45, 0.55, 0.75, 0.93)


def lookup_band(m: int) -> int:
    """The band of a repeat of m >= 1 tokens."""
    return sum(1 for start in LOOKUP_BANDS[1:] if m >= start)


@dataclass
class DraftLengths:
    """The one controller of a request's drafters. Each step the lookup drafter, where
    it finds a repeat of m tokens, proposes the length that m's band's measured
    acceptance pays for; elsewhere the feature head (if any) proposes the length its
    own acceptance pays for; where it proposes nothing (its acceptance does not pay,
    or it cannot draft for the slot) the draft model (if any) proposes the length its
    acceptance pays for; nobody where none pays. A step where lookup finds no repeat
    teaches its estimates nothing. `lookup_cap[m - 1]`: the most the request lets
    lookup propose after m tokens."""

    model: DraftLength | None
    bands: list[DraftLength]
    lookup_cap: tuple[int, ...]
    head: DraftLength | None = None

    @classmethod
    def start(cls, n_model: int, model_cost: float, lookup_cap: tuple[int, ...],
              lookup_cost: float, prior: float, n_head: int = 0,
              head_cost: float = 0.3) -> DraftLengths:
        n_lookup = max(lookup_cap, default=0)
        return cls(DraftLength.start(n_model, model_cost, prior) if n_model > 0 else None,
                   [DraftLength.start(n_lookup, lookup_cost, p) for p in LOOKUP_PRIORS]
                   if n_lookup > 0 else [], lookup_cap,
                   DraftLength(n_head, head_cost, accepted=prior * PRIOR_TRIALS,
                               tried=PRIOR_TRIALS, decline=HEAD_DECLINE)
                   if n_head > 0 else None)

    def next(self) -> tuple[int, tuple[int, ...], int]:
        """The next step's draft-model length, lookup lengths by match length and head
        length."""
        n_model = self.model.next() if self.model is not None else 0
        n_head = self.head.next() if self.head is not None else 0
        if not self.bands:
            return n_model, (), n_head
        per_band = [b.next() for b in self.bands]
        return n_model, tuple(min(cap, per_band[lookup_band(m)])
                              for m, cap in enumerate(self.lookup_cap, start=1)), n_head

    def observe(self, asked: tuple[int, tuple[int, ...], int], by_lookup: bool, match: int,
                drafted: int, accepted: int, by_head: bool = False) -> None:
        """A step asked for `asked` (`next`); the lookup drafter found a repeat of
        `match` tokens (0: none) and made the proposals (by_lookup), or the head did
        (by_head), or the model (or nobody): `drafted` of them, `accepted` kept. The
        head asked for proposals and making none (below p_min, or a slot it cannot
        draft for) is the head's failure; a model that drafted then had the step."""
        n_model, lookup_k, n_head = asked
        if match > 0 and self.bands and self.lookup_cap[match - 1] > 0:
            band = self.bands[lookup_band(match)]
            # a band asked for nothing idles towards its next probe
            band.observe(lookup_k[match - 1] if by_lookup else 0, drafted, accepted)
        if by_lookup:
            return
        if self.head is not None:
            if by_head:
                self.head.observe(n_head, drafted, accepted)
                return
            self.head.observe(n_head, 0, 0)
            if n_head > 0 and drafted == 0:
                return  # the head's step (it declined): the model sat it out
        if self.model is not None:
            self.model.observe(n_model, drafted, accepted)
