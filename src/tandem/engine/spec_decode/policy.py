"""How many tokens each request may propose this step: adaptive speculation (torch-free).

With `adaptive=False`, always k = `num_speculative_tokens`. Otherwise:

- Acceptance: a per-token acceptance estimate `a` per request, an EMA over verified draft
  positions. A verification of `proposed` drafts that kept the first `accepted` tested
  `accepted` positions that passed and, when `accepted < proposed`, one that failed (the
  positions after the first miss were never tested, so they do not count as misses). A new
  request starts from the global EMA (all requests' positions), itself from `prior`.
- Gain: with independent per-position acceptance `a`, k drafts yield
  E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens (k + 1 when a = 1).
- Cost: a step running T tokens costs cost(T) = 1 + T / saturation_tokens (+ k * draft_cost
  per request for proposers whose drafting is not free), in units of a one-token step. On
  CPU a decode step reads every weight once whatever the batch, so it is weight-read bound
  until the batch reaches tens of rows (default saturation 24) and then compute bound (each
  extra token costs about as much as another step / saturation); on a GPU saturation is in
  the hundreds.
- Choice: the step does U useful tokens of work (starting at U = T = `batch_tokens`: every
  decode and prefill token) at cost(T). Requests in order pick the k maximising the step's
  throughput (U + E(k) - 1) / cost(T + k), then U += E(k) - 1, T += k. k = 0 unless the best
  ratio beats k = 0's by `margin` (relative). Throughput of the whole step, not of the
  request alone: a request's drafts slow every request in the batch, so at high load (T
  large) a draft position is worth it only when its gain nears 1, and speculation backs off;
  with low acceptance it backs off at any load.
- Probe: a request held at k = 0 for `probe_period` steps gets k = 1 once (so its estimate
  can recover), unless even a perfect draft (a = 1) would lose at this load.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.spec_decode.config import SpeculativeConfig


def expected_tokens(a: float, k: int) -> float:
    """E(k): tokens emitted by a verification of k drafts with per-position acceptance a."""
    if a >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


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
        self.draft_cost = float(draft_cost)
        self.probe_period = probe_period
        self.alpha = ema_alpha
        self.global_alpha = global_alpha
        self.global_acceptance = prior
        self.margin = margin
        self._reqs: dict[str, _ReqState] = {}
        self.num_probes = 0  # k = 1 probes handed out (diagnostics)

    def acceptance(self, request_id: str) -> float:
        """The current per-position acceptance estimate of a request."""
        st = self._reqs.get(request_id)
        return self.global_acceptance if st is None else st.acceptance

    def _cost(self, tokens: float, k: int) -> float:
        return 1.0 + tokens / self.saturation + k * self.draft_cost

    def _best_k(self, a: float, useful: float, tokens: int) -> tuple[int, float]:
        """(k, E(k)) maximising the step's throughput; k = 0 unless it wins by margin."""
        base = useful / self._cost(tokens, 0)
        best_k, best_ratio = 0, base
        for k in range(1, self.k + 1):
            ratio = (useful + expected_tokens(a, k) - 1.0) / self._cost(tokens + k, k)
            if ratio > best_ratio:
                best_k, best_ratio = k, ratio
        if best_ratio <= base * (1.0 + self.margin):
            return 0, 1.0
        return best_k, expected_tokens(a, best_k)

    def choose(self, request_ids: list[str], batch_tokens: int) -> list[int]:
        """k_i in [0, num_speculative_tokens] per request; `batch_tokens` = tokens the step
        runs without drafts (these requests' decode tokens and others' prefill chunks)."""
        if not self.adaptive:
            return [self.k] * len(request_ids)
        tokens = max(int(batch_tokens), 0)
        useful = float(tokens)
        out: list[int] = []
        for rid in request_ids:
            st = self._reqs.get(rid)
            if st is None:
                st = self._reqs[rid] = _ReqState(self.global_acceptance)
            k, gain = self._best_k(st.acceptance, useful, tokens)
            if k == 0:
                st.zero_streak += 1
                if st.zero_streak >= self.probe_period and self._best_k(1.0, useful,
                                                                         tokens)[0] > 0:
                    k, gain = 1, expected_tokens(st.acceptance, 1)
                    self.num_probes += 1
            if k:
                st.zero_streak = 0
            out.append(k)
            useful += gain - 1.0
            tokens += k
        return out

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
