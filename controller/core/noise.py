"""How the lab tells a real gain from noise: paired runs, one decision per pair.

The same `train.py` run twice lands at two val_bpb values. Most of that spread
comes from what two programs can share: the harness seed, which sets the order
of the training data and (through `SEED`) the initialisation. Measured on an
H100 at a 45-s budget (`bench/perf/promotion_bench.py` says where), the master
spread 0.0048 across seeds, while a real change (`MATRIX_LR = 0.022`) moved
every seed by -0.0059 to -0.0081: an sd of 0.0011 around its mean. Compared
like with like, a gain of a few thousandths shows; compared across seeds, it
drowns. So the lab compares like with like:

- **Places.** The lab draws a sequence of secret harness seeds from its key
  (`place_seed`): place 1, 2, 3, ... A candidate's i-th run takes place i, and
  so does the master's run it is compared with (common random numbers). The
  master's value at each place is measured once and reused by every candidate;
  a promoted candidate's own runs become the new master's values, so a
  promotion needs no new baseline.
- **Pairs, judged as they come** (`decide`). After each pair the lab decides:
  promote, reject, or one more pair. The variance is the pairs' own, so a
  candidate that spreads wide (another `SEED`: a new initialisation on every
  seed) only makes its own test harder, and no spread measured on another
  program, an older master included, enters a decision.
- **The test.** A one-sample Student's t on the paired gains (master minus
  candidate), looked at after pairs FIRST_LOOK..cap, with the test's level
  split over those looks (Bonferroni, `look_share`): whatever the stopping,
  noise passes with probability at most the level. We chose this over an SPRT or a
  mixture (always-valid) likelihood ratio because the spread is unknown and
  differs from program to program: the scale-invariant mixture (a Bayes factor
  on the t statistic) needs 6 to 8 pairs for a gain of 3 paired sds where the
  split t needs 4 to 5 (`bench/perf/promotion_bench.py --sequential` prints
  both). A pair cannot judge its own spread, so no look comes before
  FIRST_LOOK; futility stops come earlier, since stopping to reject never
  raises the chance of a false promotion: a candidate no better than the
  master so far (mean gain <= 0) stops at once, one whose gains sit within
  FUTILITY_T standard errors of zero stops from the second pair on.
- **The level, online FDR (LORD++).** Each decision is one test in the lab's
  whole campaign, numbered when its first run starts. The t-th test runs at
  `lord_level(t, discoveries)`: LORD++ (Ramdas, Yang, Wainwright and Jordan,
  2017) spends a share GAMMA(t - tau) of the level FDR for each earlier
  promotion tau (and of W0 before any), so every promotion earns level back
  and a long plateau against one master does not drive it to nothing. It
  bounds the expected share of false promotions among promotions by FDR, and
  no test runs above LEVEL_CAP, which bounds false promotions per null
  candidate. `docs/promotion.md` says why we chose it over a budget that
  shrinks with every test (`test_alpha`, the rule before; still read for
  statuses written by an older controller).
- **At the cap.** A decision past `cap` pairs whose 95 % interval still
  excludes no effect goes on, up to `hard_cap(cap)`; there it ends
  undecided, with the pairs it would likely need (`Step.more_pairs`), never
  as a measured rejection: the same candidate may be applied again and
  continues from its pairs. "No measurable effect" is said only where the
  interval allows no effect.
- **What the lab can see** (`detectable_gain`): the smallest gain, in paired
  sds, that the first test against a master promotes with 90 % power within
  the cap. `autolab noise` multiplies it by the paired sd it measures.

A lab may ask for one pair to decide (`promotion.confirmRuns: 0`, or a number
for `minDelta` with confirmRuns unsaid): the candidate is promoted when its
place-1 run beats the master's place-1 value by more than minDelta. That is
for labs that know their own noise (a deterministic stand-in, a smoke test).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from functools import lru_cache

# One-sided level of the first test against a master. With the futility stops and the looks
# split over the cap, a change that does nothing passes the first test 0.9 % of the time and a
# gain of 3 paired sds 99.7 % (in 4.6 pairs; at 0.025 it was 1.4 %).
ALPHA = 0.015
FIRST_LOOK = 3          # the first pair count at which the test may promote (2 df)
FUTILITY_T = 1.0        # from 2 pairs on: a gain this few standard errors from zero stops
MAX_PAIRS = 10          # the cap on pairs of one decision (`promotion.maxPairs`): past it, only
                        # a decision whose interval excludes no effect goes on (to `hard_cap`)
POWER = 0.9             # what `detectable_gain` asks of the test
NOISE_RUNS = 5          # places `autolab noise` measures when the lab does not say
# Harness seeds of places lie above this (seed 0 was the first run's, 1..N the old noise runs).
PLACE_SEEDS = 1000
# How many seeds above PLACE_SEEDS a place's seed is drawn from: enough that a run that reads its
# seed learns nothing of its place, and below 2**32 - 43, so SEED = 42 + seed fits any RNG.
PLACE_SEED_RANGE = 2**31
# The online FDR control of the whole campaign (`lord_level`). FDR: the share of promotions that may
# be false, in expectation. LEVEL_CAP: no test runs above it, so a change that does nothing is
# promoted at most 1 time in 100. W0: LORD++'s starting wealth (half of FDR: the first promotion
# earns the other half back). GAMMA: the level a promotion earns is spent over the tests after it
# as GAMMA(j) ~ (j + GAMMA_SHIFT)^-GAMMA_EXPONENT (sum 1): flatter (a larger shift, a smaller
# exponent) keeps the 20th test against one master closer to the first; steeper gives the first
# few tests after a promotion more.
FDR = 0.05
LEVEL_CAP = 0.01
W0 = FDR / 2
GAMMA_EXPONENT = 1.5
GAMMA_SHIFT = 4.0
# Attempts of one experiment on successive masters (its first run and rebased follow-ups).
MAX_ATTEMPTS = 10


def place_seed(key: bytes, place: int) -> int:
    """The harness seed of `place` (1, 2, ...), drawn from the lab's secret `key`.

    The same key and place give the same seed, so every candidate and the master meet at place
    i on the same data order and initialisation, and a restarted controller adopts its runs.
    A run sees its seed (`$AUTOLAB_SEED`, its data); seeds drawn from a secret key say nothing
    of the place, so a candidate cannot tell which run of a decision it is, nor a promoted
    program which places its successors will be judged on."""
    digest = hashlib.sha256(key + f":place:{place}".encode()).digest()
    return PLACE_SEEDS + 1 + int.from_bytes(digest[:8], "big") % PLACE_SEED_RANGE


def test_alpha(tries: int) -> float:
    """The level of the `tries`-th test against one master under the rule before LORD++ (1:
    ALPHA; sums to 2 * ALPHA): statuses of an older controller that carry no `level` use it."""
    k = max(1, tries)
    return 2 * ALPHA / (k * (k + 1))


@lru_cache(maxsize=4)
def _gamma_norm(exponent: float, shift: float) -> float:
    """sum over j >= 1 of (j + shift)^-exponent, to about 1e-9: the sum to 10^5 and the integral
    of the tail."""
    n = 100_000
    head = math.fsum((j + shift) ** -exponent for j in range(1, n + 1))
    return head + (n + shift + 0.5) ** (1 - exponent) / (exponent - 1)


def gamma(j: int) -> float:
    """LORD++'s spending sequence: the share of a promotion's earned level spent on the j-th
    test after it (j >= 1; 0 before). Non-increasing, sums to 1."""
    if j < 1:
        return 0.0
    return (j + GAMMA_SHIFT) ** -GAMMA_EXPONENT / _gamma_norm(GAMMA_EXPONENT, GAMMA_SHIFT)


def lord_level(t: int, discoveries: list[int] | tuple[int, ...] = ()) -> float:
    """The level of the lab's `t`-th test (1-based, over the whole campaign), given the test
    numbers of the promotions known when it starts (each < t).

    LORD++: W0 * GAMMA(t) + (FDR - W0) * GAMMA(t - tau_1) + FDR * sum_{j >= 2} GAMMA(t - tau_j),
    capped at LEVEL_CAP. A lower level than LORD++ allows never breaks its bound, so the cap
    keeps it."""
    taus = sorted(d for d in discoveries if 0 < d < t)
    level = W0 * gamma(t)
    for i, tau in enumerate(taus):
        level += (FDR - W0 if i == 0 else FDR) * gamma(t - tau)
    return min(LEVEL_CAP, level)


def hard_cap(cap: int) -> int:
    """Where a decision past its cap (`promotion.maxPairs`), whose interval excludes no effect,
    ends undecided: half the cap again, at least 3 more pairs."""
    return cap + max(3, cap // 2)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def spread(values: list[float]) -> float | None:
    """The sample standard deviation (n - 1); None with fewer than two values."""
    if len(values) < 2:
        return None
    m = mean(values)
    return math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1))


@lru_cache(maxsize=512)
def t_crit(df: int, alpha: float = ALPHA) -> float:
    """The one-sided (1 - alpha) quantile of Student's t with `df` degrees of freedom (2.571
    for 5 at 0.025), found by bisection on the distribution's upper tail."""
    if df <= 0:
        return math.inf
    lo, hi = 0.0, 1.0
    while _t_upper_tail(hi, df) > alpha:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_upper_tail(mid, df) > alpha else (lo, mid)
    return hi  # the upper end: never below the quantile


def _t_upper_tail(t: float, df: int) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom, t >= 0."""
    return 0.5 * _beta_regularised(df / 2.0, 0.5, df / (df + t * t))


def _beta_regularised(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b): its continued fraction, evaluated
    by the modified Lentz method, on the side of x where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _beta_regularised(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300  # keeps a vanishing denominator from dividing by zero
    f, c, d = 1.0, 1.0, 0.0
    for i in range(500):
        m = i // 2
        if i == 0:
            term = 1.0
        elif i % 2 == 0:
            term = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            term = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + term * d
        d = 1.0 / (tiny if abs(d) < tiny else d)
        c = 1.0 + term / c
        c = tiny if abs(c) < tiny else c
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


@dataclass(frozen=True)
class Step:
    """What the pairs so far decide: `promote`, `reject` or `continue` (one more pair)."""

    decision: str
    pairs: int
    gain: float                 # mean of master - candidate over the pairs (positive: better)
    standard_error: float       # of that mean (inf with one pair)
    t: float                    # gain / standard_error
    critical: float             # what t must pass at this look (inf: no look yet)
    low: float                  # a 95 % interval on the gain (two-sided, Student's t)
    high: float
    alpha: float
    why: str                    # why it stopped, or why it goes on, in a sentence
    more_pairs: int = 0         # undecided: the pairs it would likely still need

    def explain(self) -> str:
        se = "" if not math.isfinite(self.standard_error) else \
            f" +- {self.standard_error:.6f} (t = {self.t:.2f}"
        need = "" if not se else (f"; {self.critical:.2f} needed at level {self.alpha:.3g})"
                                  if math.isfinite(self.critical) else ")")
        more = f"; about {self.more_pairs} more pair{'s' if self.more_pairs != 1 else ''} " \
            "would likely decide it" if self.decision == "undecided" else ""
        return (f"{self.pairs} pair{'s' if self.pairs != 1 else ''}: gain {self.gain:+.6f}"
                f"{se}{need}: {self.why}{more}")


# How the level is split over the looks: more where a gain of about 3 paired sds stops (4-6
# pairs), less at the first look (2 df: it passes only what is plain) and after. Against an
# even split, a 3-sd gain is promoted in 4.6 pairs instead of 4.9, a 2-sd gain 91 % of the time
# instead of 94 %, and no-ops as often (0.9 %) (`promotion_bench.py --sequential`).
LOOK_WEIGHTS = {3: 1.0, 4: 2.0, 5: 2.0, 6: 1.5}
LATE_LOOK_WEIGHT = 0.5


def look_share(n: int, cap: int) -> float:
    """The share of the test's level spent at the look after `n` pairs (they sum to 1 over the
    looks FIRST_LOOK..cap: by the union bound, the test's level holds however it stops)."""
    weight = lambda k: LOOK_WEIGHTS.get(k, LATE_LOOK_WEIGHT)  # noqa: E731
    return weight(n) / sum(weight(k) for k in range(FIRST_LOOK, max(FIRST_LOOK, cap) + 1))


def decide(gains: list[float], alpha: float = ALPHA, cap: int = MAX_PAIRS,
           min_delta: float = 0.0, futility: float | None = None, extend: bool = True) -> Step:
    """The sequential test on paired gains (master - candidate at each place, in order).

    Stops to reject when the mean gain is not above zero, when from the second pair on it
    lies within FUTILITY_T standard errors of zero, or at `cap` where its 95 % interval allows
    no effect or a loss; stops to promote when, from FIRST_LOOK pairs on, the t statistic
    passes the one-sided quantile at its share of alpha (split over the looks to
    `hard_cap(cap)`) and the mean gain is above `min_delta` (a number the lab asked for; 0 with
    `auto`). Past `cap`, a decision whose interval excludes no effect goes on; at
    `hard_cap(cap)` it ends `undecided`, saying how many more pairs would likely decide it.
    `futility` (FUTILITY_T unless given) and `extend=False` (reject at the cap, looks split to
    the cap) let the campaign bench run the rules of earlier defaults on the same code.
    """
    futility = FUTILITY_T if futility is None else futility
    n = len(gains)
    g = mean(gains)
    sd = spread(gains) if n >= 2 else None
    se = math.inf if sd is None else sd / math.sqrt(n)
    t = (math.inf if g > 0 else -math.inf) if se == 0 else (g / se if math.isfinite(se) else 0.0)
    last = hard_cap(cap) if extend else cap
    crit = t_crit(n - 1, alpha * look_share(n, last)) if n >= FIRST_LOOK else math.inf
    half = t_crit(n - 1, 0.025) * se if n >= 2 and se > 0 else (0.0 if se == 0 else math.inf)
    step = dict(pairs=n, gain=g, standard_error=se, t=t, critical=crit, low=g - half,
                high=g + half, alpha=alpha)
    if g <= 0:
        return Step("reject", why="no better than the master on these seeds", **step)
    if n >= 2 and t < futility:
        return Step("reject", why=f"within {futility:g} standard errors of no effect", **step)
    if t > crit:
        if g > min_delta:
            return Step("promote", why="a real gain", **step)
        return Step("reject", why=f"a real gain, but not above promotion.minDelta {min_delta:g}",
                    **step)
    if n >= cap and (step["low"] <= 0 or not extend):
        return Step("reject", why=f"not shown within the cap of {cap} pairs", **step)
    if n >= last:
        return Step("undecided", why=f"a gain its interval keeps above zero, not shown at its "
                                     f"level within {n} pairs", more_pairs=_more_pairs(
                                         g, sd or 0.0, n, alpha, last), **step)
    if n >= cap:
        return Step("continue", why=f"past the cap of {cap} pairs, its interval excludes no "
                                    f"effect: up to {last} pairs", **step)
    return Step("continue", why="one more pair decides", **step)


def _more_pairs(gain: float, sd: float, n: int, alpha: float, last: int) -> int:
    """About how many more pairs a decision with this mean gain and spread would need for its t
    to pass the last look's quantile (the gain and spread taken as they are)."""
    if gain <= 0 or sd <= 0:
        return 1
    need = n
    while need < 100 * max(1, n):
        need += 1
        if gain * math.sqrt(need) / sd > t_crit(need - 1, alpha * look_share(last, last)):
            break
    return need - n


def one_pair(gain: float, min_delta: float) -> Step:
    """The decision of a lab that lets one pair decide: promote above `min_delta`."""
    win = gain > min_delta
    return Step("promote" if win else "reject", 1, gain, math.inf, 0.0, math.inf, -math.inf,
                math.inf, 0.0, f"{'above' if win else 'not above'} promotion.minDelta "
                               f"{min_delta:g} on one pair")


@lru_cache(maxsize=64)
def detectable_gain(alpha: float = ALPHA, cap: int = MAX_PAIRS, power: float = POWER,
                    trials: int = 4000) -> float:
    """The smallest gain, in paired sds, that `decide` promotes with `power` within `cap`.

    The test is scale-free, so this is one number per level and cap; found by bisection over
    `trials` simulated decisions on normal pairs (a fixed generator: the same answer each time).
    """
    def promoted(delta: float) -> float:
        rng = random.Random(12345)
        hits = 0
        for _ in range(trials):
            gains: list[float] = []
            while True:
                gains.append(rng.gauss(delta, 1.0))
                step = decide(gains, alpha, cap)
                if step.decision != "continue":
                    hits += step.decision == "promote"
                    break
        return hits / trials

    lo, hi = 0.0, 8.0
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if promoted(mid) < power else (lo, mid)
    return round(hi, 2)
