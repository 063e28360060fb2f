"""A lower bound on a lockstep step's overhead: what no plan of the samples beats.

A lockstep step costs Σ_j max_r cost(r, j); its ideal is Σ cost / dp. With cost(L) = a·L + b·L²
(no per-sample constant) and a token cap, a bin whose longest sample is l holds at most cap
tokens, so it costs at most U(l) = a·cap + b·(l² + (cap - l)·min(cap - l, l)); a slot waits at
least for its longest sample's cost C. Samples longer than cap/2 ("long") each lead a bin of
their own, and any other bin costs at most U_s = U(longest short sample). So a slot whose long
samples are S (max s) costs at least Σ_{f in S} (C(s) - U(f))⁺ + (dp - |S|)·(C(s) - U_s)⁺ above
dp times its mean; moving a longer sample into the slot with the longer maximum never raises
that sum (U rises with l above cap/2), so the best split puts the long samples, sorted, into
consecutive blocks of at most dp, found by a dynamic programme over block ends. It holds
whatever the micro-batch count. With few samples near the cap (`benchmarks/lockstep.py`'s agent
steps at σ 0.6) it is above 0.003 on some steps.

Example (dp 2, cap 10, cost = L², so a = 0, b = 1): samples 9, 3, 3, 3. The 9 is long; the
longest short sample is 3, U_s = U(3) = 9 + 7·3 = 30, C(9) = 81: the 9's slot waits 81 where its
other bin costs at most 30, so the step is at least (81 - 30) / 2 = 25.5 above its ideal of
(81 + 27) / 2 = 54: overhead >= 1 + 25.5 / 54 = 1.47.
"""

from __future__ import annotations

import numpy as np

__all__ = ["lockstep_bound"]


def lockstep_bound(length: np.ndarray, *, a: float, b: float, dp: int, cap: int) -> float:
    """overhead - 1 that no lockstep plan of ``length`` (``[n]`` tokens, each <= ``cap``) over
    ``dp`` ranks beats, for cost(L) = a·L + b·L² (module docstring); 0 for an empty step."""
    s = np.sort(np.asarray(length, dtype=np.float64))[::-1]
    ideal = float((s * (a + b * s)).sum()) / dp
    if ideal <= 0:
        return 0.0

    def most(ell: np.ndarray) -> np.ndarray:  # U(l): the costliest bin led by a sample of l
        rest = cap - ell
        return a * cap + b * (ell**2 + rest * np.minimum(rest, ell))

    long = s[s > cap / 2]
    short = s[s <= cap / 2]
    u_short = float(most(short[:1])[0]) if len(short) else 0.0
    c, u = long * (a + b * long), most(long)
    best = np.zeros(len(long) + 1)  # best[i]: the first i long samples, in blocks
    for i in range(1, len(long) + 1):
        g = np.arange(1, min(dp, i) + 1)  # the last block: long samples i - g .. i - 1
        top = c[i - g]  # [G] each block's slot waits for its first (longest)
        f = np.arange(i - g[-1], i)  # the long samples any of the blocks may hold
        inside = f[None, :] >= (i - g)[:, None]  # [G, F]
        wait = (np.maximum(top[:, None] - u[f][None, :], 0.0) * inside).sum(axis=1)
        wait += (dp - g) * np.maximum(top - u_short, 0.0)
        best[i] = float((best[i - g] + wait).min())
    return float(best[-1]) / dp / ideal
