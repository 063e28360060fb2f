"""A minimal consumer of `rolltool pack` output: a tiny causal LM trained with the packed files.

    rolltool pack examples/rollouts.parquet --dp 8 -o packed && python examples/train_loop.py packed

Why the plain sum is right: every token's `loss_weight` already divides by the *step's*
denominator (e.g. 1 / trainable tokens of the whole step, over all ranks), so summing
`loss_weight * token_loss` over a rank's rows and summing gradients over ranks gives exactly the
step's loss, however the samples were packed. (DDP averages gradients over ranks: multiply by dp.)
Here one process plays every rank in turn, so gradients simply accumulate.
"""

import itertools
import sys

import torch

import rolltool

VOCAB, DIM = 256, 32
ds = rolltool.open_packed(sys.argv[1] if len(sys.argv) > 1 else "packed")
emb, mix, head = (
    torch.nn.Embedding(VOCAB, DIM),
    torch.nn.Linear(2 * DIM, DIM),
    torch.nn.Linear(DIM, VOCAB),
)
params = [*emb.parameters(), *mix.parameters(), *head.parameters()]
opt = torch.optim.AdamW(params, lr=1e-3)


def token_logprobs(mb: dict) -> torch.Tensor:
    """log p(x_t | x_<t) for every token; context = causal mean of the token's own segment only."""
    ids = mb["input_ids"].long() % VOCAB
    x = emb(ids)
    cu = mb["cu_seqlens"].tolist()
    # Causal mean that restarts at every segment boundary (a linear-time stand-in for attention
    # with cu_seqlens): no token sees another sample.
    ctx = torch.cat(
        [x[a:b].cumsum(0) / torch.arange(1, b - a + 1)[:, None] for a, b in itertools.pairwise(cu)]
    )
    h = torch.tanh(mix(torch.cat([x, ctx], dim=-1)))
    logp = torch.log_softmax(head(h), dim=-1)[:-1].gather(1, ids[1:, None])[:, 0]
    first = torch.zeros(len(ids), dtype=torch.bool)
    first[cu[:-1]] = True  # a segment's first token has no prediction inside its own segment
    return torch.cat([torch.zeros(1), logp]).masked_fill(first, 0.0)


for step in range(ds.num_steps):
    opt.zero_grad()
    step_loss = 0.0
    for rank in range(ds.dp):  # one process plays every rank; real ranks sum gradients
        for mb in ds.micro_batches(step, rank, torch=True):
            token_loss = -mb["advantages"] * token_logprobs(mb)  # REINFORCE-style policy loss
            loss = (mb["loss_weight"] * token_loss).sum()
            loss.backward()
            step_loss += loss.item()
    opt.step()
    meta = ds.step_meta(step)
    print(
        f"step {step}: loss {step_loss:+.5f}  samples {meta.samples}  trainable tokens {meta.trainable_tokens:,}"
    )
