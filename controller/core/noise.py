"""How far apart two runs of one program land, and what that makes a win.

The same `train.py` run twice lands at two val_bpb values: the seed, the data
order and the machine move it. A lab that promotes on one run against one run
promotes noise. This module holds the numbers of that judgement, pure:

- `spread(values)`: the master's spread, from repeat runs that differ only in
  the seed the harness sets (`autolab noise`).
- `margin(min_delta, sigma)`: what one run must beat the master by. A number
  is taken as written; `auto` is `MARGIN_Z * sigma * sqrt(2)`: the difference
  of two single runs has a standard deviation of sigma * sqrt(2), and sigma is
  itself estimated from a few runs, so the margin is wide (3.5 of those):
  noise alone clears it in about one comparison in 4,000 when sigma is right,
  and in about one in 50 when sigma came out 40 % low.
- `confirm_runs(min_delta, asked, gain, need)`: how many confirm runs a first
  run that beat the master by `gain` needs before a verdict. With `auto` and
  nothing asked (the default), a win beyond the margin is confirmed by
  AUTO_CONFIRM_RUNS runs of each program: the margin is a screen, one draw
  against a sigma estimated from a few runs, so an agent that submits many
  behaviourally equal variants (another SEED, a dead constant) would buy a lucky
  draw sooner or later (about one in 50 when sigma came out 40 % low); a fresh
  test on runs that did not pick the win makes that draw worthless. Asked for
  (`promotion.confirmRuns: N`), every improvement is confirmed, one inside the
  margin too: more sensitive, and more runs. 0 asks for none.
- `confirm(candidate, master, noise, alpha)`: the test a confirmed win must
  pass: N fresh runs of the candidate and N of the master, on harness seeds of
  their own (`confirm_seeds`: drawn at random above CONFIRM_SEEDS, paired, none a
  noise run's, none telling a run its place), and a one-sided
  two-sample Student's t-test at level `alpha` that the candidate's mean is
  lower. The level is `confirm_alpha(tries)`: ALPHA for the
  first test against a master, and less for each later one against the same
  master (2 * ALPHA / (k * (k + 1)) for the k-th), so however many variants a
  campaign sends through confirm runs against one master, noise gets at most
  2 * ALPHA of false promotions out of all of them together, not ALPHA each.
  The variance is pooled from the fresh runs and, when the lab measured its
  noise, from those repeat runs too (their degrees of freedom count). The
  first run, which picked the win, is not part of the test, so its luck cannot
  carry the decision.
- `within_noise(difference, sigma)`: a difference inside NOISE_Z two-run
  standard deviations is "no measurable effect", not a regression.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

MARGIN_Z = 3.5          # `minDelta: auto` = 3.5 sigma of a difference of two single runs
NOISE_Z = 2.0           # |difference| <= 2 sigma of a two-run difference: no measurable effect
ALPHA = 0.025           # one-sided level of the confirm test
# Repeat runs of the master that measure sigma when a lab does not say (`promotion.noiseRuns`).
# sigma from n runs is itself noisy, and an underestimate narrows the margin: a program that
# changes nothing clears the `auto` margin in about one try in 40 with 3 runs, one in 190 with
# 5 and one in 900 with 8 (Monte Carlo over the estimate, the thirteenth session's RESULTS).
NOISE_RUNS = 5
# Confirm runs of each program for a win beyond the `auto` margin when the lab asks for none:
# with the lab's noise runs pooled in, two of each give the t-test 4-5 degrees of freedom, so
# a true win at the margin (4.9 sigma) passes about nine times in ten and a lucky draw of a
# no-op passes one time in 40.
AUTO_CONFIRM_RUNS = 2
# Harness seeds of confirm runs lie above this: the i-th confirm run of the candidate and of
# the master both take the i-th of the seeds `confirm_seeds` drew (paired: the same data order
# for both programs), never a seed the lab's noise runs took (1..noiseRuns, and the few that
# replace a failed one). A machine that reproduces a seed closely (a GPU nearly does) would
# otherwise give the master's confirm runs the values of its noise runs, and the test would
# count those draws twice. An experiment confirmed by an older controller has no drawn seeds
# in its status; its i-th confirm runs take CONFIRM_SEEDS + i, as they always did.
CONFIRM_SEEDS = 1000
# How many seeds above CONFIRM_SEEDS a confirm run's seed is drawn from: enough that a run
# that reads its seed learns nothing from it (two experiments share a seed at one place about
# once in two billion), and below 2**32 - 43, so train.py's SEED = 42 + seed fits any RNG.
CONFIRM_SEED_RANGE = 2**31
# Attempts of one experiment on successive masters (its first run and rebased follow-ups).
# Each follow-up answers a promotion, so the count is bounded anyway; the cap bounds what one
# experiment spends while a lab keeps promoting others.
MAX_ATTEMPTS = 10


def confirm_seeds(entropy: int, n: int) -> list[int]:
    """The harness seeds of `n` pairs of confirm runs: n distinct seeds, drawn from `entropy`.

    A run's seed reaches the candidate (as `$AUTOLAB_SEED`, and through the training data's
    start offset), and confirm runs go in a fixed order (c1 m1 m2 c2 c3 m3 ...; see
    `controller.core.reconcile.next_run`). Seeds that counted up (1001, 1002, ...) told a
    candidate its place, and its place tells it whose run comes next on its machine: the
    master's exactly after c1, c3, c5. A candidate that left the machine slow (a hot GPU, an
    emptied page cache) only then slowed the master's runs and none of its own, and won by it.
    Seeds drawn at random from a range far larger than any lab's confirm runs say nothing of
    the place; the order stays fixed, and what a candidate leaves behind falls on both
    programs alike in expectation, whatever it guesses.

    Pure: the randomness is `entropy` (the `World` carries one draw of the front end's), so
    the same entropy gives the same seeds. They are kept in the Experiment's status, which no
    run can read, and drawn once, when the confirm runs start.
    """
    rng = random.Random(entropy)
    return rng.sample(range(CONFIRM_SEEDS + 1, CONFIRM_SEEDS + 1 + CONFIRM_SEED_RANGE), n)


def noise_seed(key: bytes, master_hash: str, i: int) -> int:
    """The harness seed of the `i`-th noise run (repeat run of the master `master_hash`).

    Seeds 1..N told a run it was a noise run (first runs take 0, confirm runs take seeds drawn
    above CONFIRM_SEEDS): a promoted program could keep a payload for those seeds alone (train
    a fixed model there, or a wild one) and set the lab's sigma, margin and reference when the
    noise is measured again on it, with no screen or confirm run ever seeing it. A seed from
    the lab's secret `key` (never in a run's reach) looks like any confirm seed, and the same
    key, master and place give the same seed, so a restarted controller adopts its runs."""
    digest = hashlib.sha256(key + f":{master_hash}:{i}".encode()).digest()
    return CONFIRM_SEEDS + 1 + int.from_bytes(digest[:8], "big") % CONFIRM_SEED_RANGE


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def spread(values: list[float]) -> float | None:
    """The sample standard deviation (n - 1); None with fewer than two values."""
    if len(values) < 2:
        return None
    m = mean(values)
    return math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1))


def margin(min_delta: float | str, sigma: float | None) -> float | None:
    """What one run must beat the master by; None when `auto` has no measured sigma yet."""
    if min_delta == "auto":
        return None if sigma is None else MARGIN_Z * sigma * math.sqrt(2)
    return float(min_delta)


def confirm_runs(min_delta: float | str, asked: int | None, gain: float | None,
                 need: float) -> int:
    """How many confirm runs of each program a first run that beat the master by `gain`
    needs (0: that run decides, against the margin `need`).

    `asked` is `promotion.confirmRuns` (None: the lab did not say).
    """
    if gain is None or gain <= 0:
        return 0
    if asked is None:
        return AUTO_CONFIRM_RUNS if min_delta == "auto" and gain > need else 0
    return asked


def confirm_alpha(tries: int) -> float:
    """The level of the `tries`-th confirm test against one master (1: the first, ALPHA).
    The levels sum to 2 * ALPHA over any number of tests."""
    k = max(1, tries)
    return 2 * ALPHA / (k * (k + 1))


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
class Verdict:
    promote: bool
    difference: float      # master mean - candidate mean (positive: the candidate is better)
    standard_error: float
    critical: float        # how many standard errors the difference must reach (Student's t)
    alpha: float = ALPHA   # the test's level (see `confirm_alpha`)

    def explain(self) -> str:
        word = "passes" if self.promote else "fails"
        return (f"confirm runs: the candidate's mean is {self.difference:+.6f} better than the "
                f"master's, {self.difference / self.standard_error if self.standard_error else 0:.2f}"
                f" standard errors ({self.standard_error:.6f}; a one-sided t-test at "
                f"{self.alpha:.3g} needs {self.critical:.2f}): it {word}")


def within_noise(difference: float, sigma: float | None) -> bool:
    return sigma is not None and abs(difference) <= NOISE_Z * sigma * math.sqrt(2)


def confirm(candidate: list[float], master: list[float], sigma: float | None = None,
            sigma_df: int = 0, alpha: float = ALPHA) -> Verdict:
    """The confirm test on fresh runs of both programs (see the module docstring).

    `sigma` and `sigma_df` are the lab's measured noise and its degrees of freedom (repeat
    runs minus one); they are pooled with the fresh runs' own spread. `alpha` is the level.
    """
    d = mean(master) - mean(candidate)
    n, m = len(candidate), len(master)
    ss = sum((x - mean(candidate)) ** 2 for x in candidate) + \
        sum((x - mean(master)) ** 2 for x in master)
    df = n + m - 2
    if sigma is not None and sigma_df > 0:
        ss += sigma ** 2 * sigma_df
        df += sigma_df
    pooled = math.sqrt(ss / df) if df > 0 else math.inf
    se = pooled * math.sqrt(1 / n + 1 / m)
    crit = t_crit(df, alpha)
    promote = math.isfinite(se) and d > 0 and d > crit * se
    return Verdict(promote, d, se, crit, alpha)
