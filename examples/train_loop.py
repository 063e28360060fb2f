"""A minimal consumer of `rolltool pack` output: one process plays every rank, step by step.

    rolltool pack examples/rollouts.parquet --dp 8 -o packed && python examples/train_loop.py packed
    python examples/train_loop.py packed --start-step 3      # resume: steps 3.. only

Why the plain sum is right: every token's `loss_weight` already divides by the *step's*
denominator (e.g. 1 / trainable tokens of the whole step, over all ranks), so summing
`loss_weight * token_loss` over a rank's rows and summing gradients over ranks gives exactly the
step's loss, however the samples were packed. (DDP averages gradients over ranks: multiply by dp.)
Here the ranks take turns in one process, so gradients simply accumulate.

The model is a linear-time stand-in (a causal mean restarting at every segment) so this runs in
seconds on the whole example; examples/train_ddp.py is the real thing: one process per rank under
torchrun, a causal transformer attending per segment, gradients all-reduced.
"""

import argparse
import itertools

import torch
from torch.utils.data import DataLoader

import rolltool

VOCAB, DIM = 256, 32

parser = argparse.ArgumentParser(description="Train a tiny model on a packed directory.")
parser.add_argument("packed", nargs="?", default="packed")
parser.add_argument("--start-step", type=int, default=0, help="resume at this step")
args = parser.parse_args()

ds = rolltool.open_packed(args.packed)
if ds.shared:  # its continuations attend to prefixes in other segments (docs/training.md)
    raise SystemExit(
        f"{args.packed} is a --share-prefix pack: this loop attends within cu_seqlens only"
    )
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
    ctx = torch.cat(
        [x[a:b].cumsum(0) / torch.arange(1, b - a + 1)[:, None] for a, b in itertools.pairwise(cu)]
    )
    h = torch.tanh(mix(torch.cat([x, ctx], dim=-1)))
    logp = torch.log_softmax(head(h), dim=-1)[:-1].gather(1, ids[1:, None])[:, 0]
    first = torch.zeros(len(ids), dtype=torch.bool)
    first[cu[:-1]] = True  # a segment's first token has no prediction inside its own segment
    return torch.cat([torch.zeros(1), logp]).masked_fill(first, 0.0)


# One loader per rank, each reading only that rank's files, from --start-step on. Items are
# whole packed micro-batches: batch_size=None. (A real rank makes only its own.)
loaders = [
    iter(DataLoader(ds.torch_dataset(rank, start_step=args.start_step), batch_size=None))
    for rank in range(ds.dp)
]
for step in range(args.start_step, ds.num_steps):
    meta = ds.step_meta(step)
    opt.zero_grad()
    step_loss = 0.0
    for rank, loader in enumerate(loaders):
        for mb in itertools.islice(loader, meta.ranks[rank].micro_batches):
            token_loss = -mb["advantages"] * token_logprobs(mb)  # REINFORCE-style policy loss
            loss = (mb["loss_weight"] * token_loss).sum()
            loss.backward()
            step_loss += loss.item()
    opt.step()
    print(
        f"step {step}: loss {step_loss:+.5f}  samples {meta.samples}  "
        f"trainable tokens {meta.trainable_tokens:,}"
    )
