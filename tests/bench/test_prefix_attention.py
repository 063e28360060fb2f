"""Shared-prefix attention (issue 24) is exact: on a tiny Llama (transformers, float64) every
sample's per-token log-probs from the shared row (prefix once, keys and values gathered) equal
the sample run alone with stock eager attention, and the gradient of the step loss
(sum of target weight x -log p) equals the unshared one's. `attend` itself is checked against
sdpa over each segment's whole chain for random segment tables.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_models import tiny_llamas

from rolltool.format.prefix import kernel_index, shared_next_token_targets, target_source
from rolltool.plan.prefix import GroupTokens, detect, lay_out

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rolltool.bench.prefix_attention import attend, prefix_tensors  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(-1, 20)), min_size=1, max_size=7),
       st.integers(0, 2**31 - 1))  # fmt: skip
def test_attend_is_each_chain_alone(segments: list[tuple[int, int]], seed: int) -> None:
    """Segment j's output is the last len_j rows of causal sdpa over its whole chain."""
    lens = np.array([n for n, _ in segments])
    parent = np.array([p if p < j else -1 for j, (_, p) in enumerate(segments)])
    cu = np.r_[0, np.cumsum(lens)]
    ix = kernel_index(cu, parent)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(int(cu[-1]), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    out = attend(q, k, v, prefix_tensors(ix))
    for j in range(len(lens)):
        rows = torch.as_tensor(ix.kv_index[ix.cu_seqlens_k[j] : ix.cu_seqlens_k[j + 1]])
        qs, ks, vs = (x[rows].repeat_interleave(4 // x.shape[1], 1).transpose(0, 1)[None]
                      for x in (q, k, v))  # fmt: skip
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        ref = ref[0].transpose(0, 1)[-int(lens[j]) :]
        torch.testing.assert_close(out[cu[j] : cu[j + 1]], ref, rtol=0, atol=1e-12)


# --- a tiny Llama --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> tuple:
    """(shared, alone): the same weights, the shared-prefix attention and stock sdpa."""
    return tiny_llamas()


def _case(name: str) -> tuple[GroupTokens, list[np.ndarray]]:
    """A group and its loss weights (dyadic: their sums are exact in the format's float32)."""
    rng = np.random.default_rng(sum(map(ord, name)))

    def toks(n: int) -> list[int]:
        return rng.integers(0, 24, n).tolist()

    prompt = toks(8)
    if name == "no common prefix":
        seqs = [[1, *toks(9)], [2, *toks(6)], [3, *toks(12)]]
        prompts = [4, 4, 4]
    elif name == "identical samples":
        seqs = [prompt + toks(7)] * 3
        prompts = [8] * 3
    elif name == "nested branches":  # a strict prefix of another sample too
        turn = toks(6)
        seqs = [prompt + turn + toks(4), prompt + turn + toks(5), prompt + toks(6),
                prompt + toks(3), prompt + turn[:4]]  # fmt: skip
        prompts = [8, 14, 8, 8, 8]  # samples 0 and 1 share an untrained trajectory (an env's)
    else:  # "trained tokens shared": a trained turn, an observation, then the branches
        turn, obs = toks(5), toks(3)
        seqs = [prompt + turn + obs + toks(k) for k in (4, 6, 1)]
        prompts = [8] * 3
    ids = [np.array(s) for s in seqs]
    mask = [(np.arange(len(s)) >= p).astype(np.int8) for s, p in zip(seqs, prompts, strict=True)]
    if name == "trained tokens shared":
        for m in mask:
            m[13:16] = 0  # the observation is not trained
    lp = [np.full(len(s), -0.75) for s in seqs]
    adv = [np.full(len(s), 0.5) for s in seqs]
    for i, a in enumerate(adv):
        a[16:] = i  # the branches' own advantages differ; the shared trained turn's do not
    weights = [rng.choice([0.25, 0.5, 1.0], len(m)) * m for m in mask]
    return GroupTokens(ids, mask, lp, adv), weights


CASES = ["no common prefix", "identical samples", "nested branches", "trained tokens shared"]


@pytest.mark.parametrize("name", CASES)
def test_shared_row_equals_each_sample_alone(models: tuple, name: str) -> None:
    shared_model, alone_model = models
    g, w = _case(name)
    lay = lay_out(detect(g, share_min=3))
    stats = lay.stats()
    if name != "no common prefix":  # the case really shares
        assert stats.prefixes >= (2 if name == "nested branches" else 1)
        assert stats.tokens_shared < stats.tokens
    if name == "trained tokens shared":  # the trained turn lies inside the shared prefix
        assert lay.end[0] >= 13 and g.loss_mask[0][8:13].all()
    ix = lay.kernel_index()
    row = {
        "input_ids": lay.gather(g.input_ids),
        "loss_weight": lay.summed(w),
        "advantages": lay.gather(g.advantages),
        "logprobs": lay.gather(g.logprobs),
        "cu_seqlens": lay.cu_seqlens,
        "sample_index": lay.sample,
    }
    targets = shared_next_token_targets(row, lay.parent)

    for model in models:
        model.zero_grad()
    ids = torch.as_tensor(row["input_ids"])[None]
    pos = torch.as_tensor(ix.position_ids)[None]
    logits = shared_model(input_ids=ids, position_ids=pos, prefix_index=prefix_tensors(ix),
                          use_cache=False).logits[0]  # fmt: skip
    logp = logits.log_softmax(-1)
    has = target_source(lay.cu_seqlens, lay.parent) >= 0
    tid = torch.as_tensor(np.where(has, targets["target_ids"], 0))
    token_logp = logp.gather(1, tid[:, None])[:, 0]
    tw = torch.as_tensor(targets["target_loss_weight"], dtype=torch.float64)
    (tw * -token_logp).sum().backward()

    unshared_loss = 0.0
    for i, x in enumerate(g.input_ids):
        alone = alone_model(input_ids=torch.as_tensor(x)[None], use_cache=False).logits[0]
        ref = alone.log_softmax(-1)[:-1].gather(1, torch.as_tensor(x[1:])[:, None])[:, 0]
        rows = torch.as_tensor(lay.sample_rows(i)[:-1])
        torch.testing.assert_close(token_logp[rows], ref, rtol=0, atol=1e-10)
        unshared_loss = unshared_loss + (torch.as_tensor(w[i][1:]) * -ref).sum()
    unshared_loss.backward()

    grads = [(a.grad, b.grad) for a, b in zip(shared_model.parameters(),
                                              alone_model.parameters(), strict=True)]  # fmt: skip
    assert all(b is not None and b.abs().sum() > 0 for _, b in grads)
    for a, b in grads:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
