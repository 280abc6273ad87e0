"""How many tokens each request may propose this step: adaptive speculation (torch-free).

With `adaptive=False`, always k = `num_speculative_tokens`. Otherwise:

- Acceptance: a per-token acceptance estimate `a` per request, an EMA over verified draft
  positions. A verification of `proposed` drafts that kept the first `accepted` tested
  `accepted` positions that passed and, when `accepted < proposed`, one that failed (the
  positions after the first miss were never tested, so they do not count as misses). A new
  request starts from the global EMA (all requests' positions), itself from `prior`.
- Gain: with independent per-position acceptance `a`, k drafts yield
  E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens (k + 1 when a = 1).
- Cost: a step running T tokens whose proposer drafts R rounds for n requests costs
  cost(T, R, n) = 1 + T / saturation_tokens + R * (draft_cost + n * draft_cost_per_row), in
  units of a zero-token target step. On
  CPU a decode step reads every weight once whatever the batch, so it is weight-read bound
  until the batch reaches tens of rows (default saturation 24) and then compute bound (each
  extra token costs about as much as another step / saturation); on a GPU saturation is in
  the hundreds. A draft model drafts in lockstep rounds (one batched forward per draft
  position for all requests), so R is the largest k of the step, and a request's drafts
  cost rounds only beyond the k already chosen (and a row in each). The round's costs (over
  a target step) and the saturation are measured when the engine reports timings
  (`observe_timing`): a weighted least-squares line through the target's step seconds
  against T (`StepCostFit`; intercept / slope = saturation, the intercept the unit) and the
  proposer's round seconds against rows (`Proposer.round_cost`); until the steps' sizes
  spread enough to fit, the constructor's saturation and `draft_cost` (0: an n-gram lookup
  is free) stand.
- Choice: the step does U useful tokens of work (starting at U = T = `batch_tokens`: every
  decode and prefill token) at cost(T, R). For a round count R, requests in order pick the
  k <= R maximising the step's throughput (U + E(k) - 1) / cost(T + k, R), then
  U += E(k) - 1, T += k; the R whose plan gives the highest throughput wins (R = k when
  drafting is free: then the rule per request is the plain sequential one). k = 0 unless
  the best ratio beats k = 0's by `margin` (relative). Throughput of the whole step, not of the
  request alone: a request's drafts slow every request in the batch, so at high load (T
  large) a draft position is worth it only when its gain nears 1, and speculation backs off;
  with low acceptance it backs off at any load.
- Catch-up: a draft model must first run the tokens it has not seen (a request's prompt, or
  the output of the steps it sat out at k = 0), at `catchup_cost` per token. That cost is
  paid once and buys speculation for the rest of the request, so a request with C such
  tokens and `remaining` tokens still to emit is charged C * catchup_cost * E(k) /
  max(remaining, E(k)) in the step it drafts (the one-off cost spread over the steps
  speculation can still save): a long prompt is not caught up for a short answer.
- Probe: a request held at k = 0 for `probe_period` steps gets k = 1 once (so its estimate
  can recover), unless even a perfect draft (a = 1) would lose at this load.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.spec_decode.base import DraftCost
from tandem.engine.spec_decode.config import SpeculativeConfig


def expected_tokens(a: float, k: int) -> float:
    """E(k): tokens emitted by a verification of k drafts with per-position acceptance a."""
    if a >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


MAX_SATURATION = 1e6  # a flat fit: extra tokens cost nothing measurable


class StepCostFit:
    """Exponentially weighted least squares of a target step's seconds on its token count,
    s = c0 + c1 * T, over the steps of at most `max_tokens` tokens (decode and verification
    sizes, where speculation's choices lie). `line()` is (c0, c1) once the weight reaches
    `min_weight` and the sizes' standard deviation `min_spread` tokens, else None.

    `add_prior` adds samples that never decay (a start-up calibration): they keep the slope
    known when the live samples stop spreading (all of one size for a while), and weigh less
    and less against the live ones as those accumulate (live weight tends to 1 / decay)."""

    def __init__(self, decay: float = 0.02, max_tokens: int = 256, min_spread: float = 1.0,
                 min_weight: float = 16.0) -> None:
        self.decay, self.max_tokens = decay, max_tokens
        self.min_spread, self.min_weight = min_spread, min_weight
        # weighted sums of 1, T, s, T*T and T*s: the live (decaying) samples and the prior
        self._live = [0.0] * 5
        self._prior = [0.0] * 5

    @property
    def w(self) -> float:
        """The live samples' weight."""
        return self._live[0]

    @staticmethod
    def _moments(tokens: int, seconds: float) -> tuple[float, ...]:
        return 1.0, tokens, seconds, tokens * tokens, tokens * seconds

    def add_prior(self, tokens: int, seconds: float, weight: float) -> None:
        for i, v in enumerate(self._moments(tokens, seconds)):
            self._prior[i] += weight * v

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > self.max_tokens:
            return
        keep = 1.0 - self.decay
        for i, v in enumerate(self._moments(tokens, seconds)):
            self._live[i] = self._live[i] * keep + v

    def line(self) -> tuple[float, float] | None:
        w, t, s, tt, ts = (a + b for a, b in zip(self._live, self._prior, strict=True))
        if w < self.min_weight:
            return None
        mt, ms = t / w, s / w
        var = tt / w - mt * mt
        if var < self.min_spread ** 2:
            return None
        c1 = max((ts / w - mt * ms) / var, 0.0)
        c0 = ms - c1 * mt
        return (c0, c1) if c0 > 0 else None


@dataclass
class _ReqState:
    acceptance: float
    zero_streak: int = 0  # consecutive steps chosen at k = 0


class SpecPolicy:
    """Per-step k per request (`choose`), learning from verifications (`observe`)."""

    def __init__(self, config: SpeculativeConfig, *, saturation_tokens: float = 24.0,
                 draft_cost: float = 0.0, probe_period: int = 16, ema_alpha: float = 0.2,
                 global_alpha: float = 0.05, prior: float = 0.6,
                 margin: float = 0.02) -> None:
        if saturation_tokens <= 0 or probe_period < 1 or not 0 < ema_alpha <= 1:
            raise ValueError("saturation_tokens > 0, probe_period >= 1, 0 < ema_alpha <= 1")
        self.k = config.num_speculative_tokens
        self.adaptive = config.adaptive
        self.saturation = float(saturation_tokens)
        self.draft_cost = float(draft_cost)  # a round's fixed cost, in target steps
        self.draft_cost_per_row = 0.0  # .. and its cost per drafting request
        self.catchup_cost = 0.0  # a draft model's cost per caught-up token, in target steps
        self.probe_period = probe_period
        self.alpha = ema_alpha
        self.global_alpha = global_alpha
        self.global_acceptance = prior
        self.margin = margin
        self.timing_alpha = 0.1
        self._unit_s: float | None = None  # seconds of a zero-token target step (cost 1)
        self.fit = StepCostFit()
        self._reqs: dict[str, _ReqState] = {}
        self.num_probes = 0  # k = 1 probes handed out (diagnostics)

    def acceptance(self, request_id: str) -> float:
        """The current per-position acceptance estimate of a request."""
        st = self._reqs.get(request_id)
        return self.global_acceptance if st is None else st.acceptance

    def _cost(self, tokens: float, rounds: int, rows: int = 1, extra: float = 0.0) -> float:
        """A step of `tokens` target tokens and `rounds` draft rounds over `rows` drafting
        requests, plus `extra` (amortised catch-ups), in units of a zero-token target step."""
        if not rounds:
            return 1.0 + tokens / self.saturation + extra
        return 1.0 + tokens / self.saturation + extra + rounds * (
            self.draft_cost + self.draft_cost_per_row * rows)

    def _catchup(self, tokens: int, remaining: int, gain: float) -> float:
        """The share of a `tokens`-token catch-up charged to a step expected to emit `gain`
        tokens of a request with `remaining` still to emit."""
        if tokens <= 0 or self.catchup_cost <= 0:
            return 0.0
        return tokens * self.catchup_cost * gain / max(float(remaining), gain)

    def observe_timing(self, step_s: float, step_tokens: int,
                       round_cost: DraftCost | None = None) -> None:
        """A target step of `step_tokens` tokens took `step_s` seconds; `round_cost`: the
        proposer's current costs (None: drafting is free).

        Once the steps' sizes spread (speculation varies them), `fit` gives the machine's
        own saturation and unit time, replacing the constructor's saturation; before that,
        and whenever the spread is too small, the last values stand."""
        if step_s <= 0 or step_tokens <= 0:
            return
        self.fit.add(step_tokens, step_s)
        line = self.fit.line()
        if line is not None:
            c0, c1 = line
            self.saturation = min(c0 / c1, MAX_SATURATION) if c1 > 0 else MAX_SATURATION
            self._unit_s = c0
        else:
            unit = step_s / (1.0 + step_tokens / self.saturation)
            self._unit_s = unit if self._unit_s is None else (
                self._unit_s + self.timing_alpha * (unit - self._unit_s))
        if round_cost is not None:
            self.draft_cost = max(round_cost.round_s, 0.0) / self._unit_s
            self.draft_cost_per_row = max(round_cost.row_s, 0.0) / self._unit_s
            self.catchup_cost = max(round_cost.catchup_token_s, 0.0) / self._unit_s

    def _best_k(self, a: float, useful: float, tokens: int, rounds: int, cap: int,
                rows: int = 0, extra: float = 0.0, catchup: int = 0,
                remaining: int = 0) -> tuple[int, float, float]:
        """(k <= cap, E(k), its catch-up charge) maximising the step's throughput given
        `rounds` already drafted for `rows` requests and `extra` charged; k = 0 unless it
        wins by margin. `catchup` / `remaining`: this request's (`_catchup`)."""
        base = useful / self._cost(tokens, rounds, rows, extra)
        best = (0, 1.0, 0.0)
        best_ratio = base
        for k in range(1, cap + 1):
            gain = expected_tokens(a, k)
            add = self._catchup(catchup, remaining, gain)
            ratio = (useful + gain - 1.0) / self._cost(tokens + k, max(rounds, k), rows + 1,
                                                       extra + add)
            if ratio > best_ratio:
                best, best_ratio = (k, gain, add), ratio
        if best_ratio <= base * (1.0 + self.margin):
            return 0, 1.0, 0.0
        return best

    def _plan(self, accs: list[float], tokens: int, rounds: int, catchup: list[int],
              remaining: list[int]) -> tuple[list[int], float]:
        """Requests in order, each k <= `rounds` with the step paying `rounds` draft rounds:
        (ks, the step's throughput paying only the max(ks) rounds the plan needs)."""
        useful, ks, rows, extra = float(tokens), [], 0, 0.0
        for a, c, left in zip(accs, catchup, remaining, strict=True):
            k, gain, add = self._best_k(a, useful, tokens, rounds, rounds, rows, extra, c, left)
            ks.append(k)
            useful += gain - 1.0
            tokens += k
            rows += k > 0
            extra += add
        return ks, useful / self._cost(tokens, max(ks, default=0), rows, extra)

    def choose(self, request_ids: list[str], batch_tokens: int,
               catchup: list[int] | None = None,
               remaining: list[int] | None = None) -> list[int]:
        """k_i in [0, num_speculative_tokens] per request; `batch_tokens` = tokens the step
        runs without drafts (these requests' decode tokens and others' prefill chunks);
        `catchup[i]`: tokens the proposer must catch up on before request i drafts
        (`Proposer.catchup_tokens`, default 0), `remaining[i]`: tokens it may still emit.

        Rounds are shared, so the step's round count R is chosen for the batch: for each R
        in 0..k a plan (`_plan`), the plan of highest throughput wins (a drafting cost of 0
        makes R = k always best, and the rule per request is then the sequential one)."""
        if not self.adaptive:
            return [self.k] * len(request_ids)
        tokens = max(int(batch_tokens), 0)
        states = []
        for rid in request_ids:
            st = self._reqs.get(rid)
            if st is None:
                st = self._reqs[rid] = _ReqState(self.global_acceptance)
            states.append(st)
        accs = [st.acceptance for st in states]
        n = len(states)
        catchup = list(catchup) if catchup is not None else [0] * n
        remaining = list(remaining) if remaining is not None else [0] * n
        if self.draft_cost > 0 or self.draft_cost_per_row > 0:
            zero = self._plan(accs, tokens, 0, catchup, remaining)[1]
            ks, best = [0] * n, zero
            for r in range(1, self.k + 1):
                plan, ratio = self._plan(accs, tokens, r, catchup, remaining)
                if ratio > best:
                    ks, best = plan, ratio
            if best <= zero * (1.0 + self.margin):
                ks = [0] * n
        else:
            ks = self._plan(accs, tokens, self.k, catchup, remaining)[0]
        gains = [expected_tokens(a, k) for a, k in zip(accs, ks, strict=True)]
        useful = tokens + sum(g - 1.0 for g in gains)
        extra = sum(self._catchup(c, left, g) for c, left, g, k in zip(
            catchup, remaining, gains, ks, strict=True) if k)
        tokens += sum(ks)
        rounds = max(ks, default=0)
        rows = sum(k > 0 for k in ks)
        for i, st in enumerate(states):
            if ks[i]:
                st.zero_streak = 0
                continue
            st.zero_streak += 1
            if st.zero_streak < self.probe_period:
                continue
            k, _, add = self._best_k(1.0, useful, tokens, rounds, 1, rows, extra, catchup[i],
                                     remaining[i])
            if k:
                ks[i] = 1
                st.zero_streak = 0
                self.num_probes += 1
                useful += expected_tokens(st.acceptance, 1) - 1.0
                tokens += 1
                rounds = max(rounds, 1)
                rows += 1
                extra += add
        return ks

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts kept the first `accepted` of them."""
        if proposed <= 0:
            return
        accepted = max(0, min(accepted, proposed))
        missed = accepted < proposed
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = _ReqState(self.global_acceptance)
        st.acceptance = self._ema(st.acceptance, self.alpha, accepted, missed)
        self.global_acceptance = self._ema(self.global_acceptance, self.global_alpha,
                                           accepted, missed)

    @staticmethod
    def _ema(a: float, alpha: float, hits: int, missed: bool) -> float:
        """`hits` observations of 1, then one of 0 when `missed`, each a <- a + alpha (x - a)."""
        a = 1.0 - (1.0 - alpha) ** hits * (1.0 - a)
        return a * (1.0 - alpha) if missed else a

    def release(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
