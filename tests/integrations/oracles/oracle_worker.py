"""One process of an oracle test (not a test module): ``python oracle_worker.py TASK RANK WORLD
PORT OUT ARGS...`` joins a gloo group of WORLD processes on 127.0.0.1:PORT, runs the real
library on rolltool's views and saves what the library returned to ``OUT/rank{RANK}.pt``; the
test process asserts on it (`oracle_ports.run_gloo`).

- ``ring PACK...``: ring-flash-attn's ``zigzag_ring_flash_attn_varlen_forward`` on CP rank
  RANK's view of every row (flash-attn's kernel replaced by `oracle_ports.flash_attn_stand_in`);
- ``verl SP_PACK... -- SEED``: verl's Ulysses ``ulysses_pad_and_slice_inputs`` and
  ``gather_outputs_and_unpad`` on every row of the ``--sp 2`` packs, then
  ``rearrange_micro_batches`` over the group as DP group, with and without
  ``rolltool.integrations.verl.patch()``; rank 0 also runs ``RayPPOTrainer._balance_batch``
  (verl declared a CPU platform first: `verl_on_cpu`);
- ``resume PACK STATE``: a torchdata ``StatefulDataLoader`` in this new process, loaded from the
  state another process saved (WORLD 1, no group).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import oracle_ports
import torch
import torch.distributed as dist

import rolltool


def rows(ds: Any, **view: int) -> Any:
    """((step, rank, micro_batch), row) over the whole pack, one GPU's view with ``view``."""
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for j, row in enumerate(ds.micro_batches(step, rank, **view)):
                yield (step, rank, j), row


def ring(rank: int, packs: list[str]) -> dict[Any, Any]:
    oracle_ports.flash_attn_stand_in()
    from ring_flash_attn.zigzag_ring_flash_attn_varlen import (
        get_half_index,
        zigzag_ring_flash_attn_varlen_forward,
    )

    tables = [torch.from_numpy(t).float() for t in oracle_ports.qkv_tables()]
    out = {}
    for path in packs:
        for key, view in rows(rolltool.open_packed(path), cp_rank=rank):
            ids = torch.from_numpy(view["input_ids"].astype(np.int64))
            q, k, v = (t[ids] for t in tables)
            cu = torch.from_numpy(view["cu_seqlens"].astype(np.int32))
            o, _ = zigzag_ring_flash_attn_varlen_forward(
                dist.group.WORLD, q, k, v, cu, int(cu.diff().max()),
                get_half_index(cu, front=True), get_half_index(cu, front=False),
                softmax_scale=oracle_ports.DIM**-0.5,
            )  # fmt: skip
            out[(path, *key)] = o
    return out


def verl_on_cpu() -> None:
    """verl 0.9.1 has no CPU platform (it falls back to CUDA, and rearrange_micro_batches puts
    its counts on ``get_device_name()``): declare one through verl's own plugin API, CUDA's
    platform with device ``cpu`` and backend ``gloo``."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import set_platform

    class PlatformCPU(PlatformCUDA):
        @property
        def device_name(self) -> str:
            return "cpu"

        def communication_backend_name(self) -> str:
            return "gloo"

    set_platform(PlatformCPU())


def ulysses(packs: list[str]) -> dict[Any, Any]:
    from verl.utils import ulysses as u

    u.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    out = {}
    for path in packs:
        for key, row in rows(rolltool.open_packed(path)):
            ids = torch.from_numpy(row["input_ids"].astype(np.int64))[None]
            pos = torch.from_numpy(row["position_ids"].astype(np.int64))[None]
            ids_s, pos_s, pad = u.ulysses_pad_and_slice_inputs(ids, pos, sp_size=2)
            # verl's actor: labels rolled over the whole row, then sliced like the inputs
            rolled, _, _ = u.ulysses_pad_and_slice_inputs(torch.roll(ids, -1, 1), None, sp_size=2)
            sliced = {
                k: u.slice_input_tensor(torch.tensor(row[k])[None], dim=1, padding=False)[0]
                for k in ("loss_mask", "advantages", "logprobs", "loss_weight")
            }
            # a per-token output computed on this rank's slice, gathered back
            local = sliced["logprobs"][:, None].double()
            tail = int(np.diff(row["cu_seqlens"])[-1]) if row["sample_index"][-1] < 0 else 0
            out[(path, *key)] = {
                "input_ids": ids_s[0], "position_ids": pos_s[0], "pad": pad, **sliced,
                "rolled": rolled[0],
                "gathered": u.gather_outputs_and_unpad(local, 0, 0, padding_size=pad),
                "unpadded": u.gather_outputs_and_unpad(local, 0, 0, padding_size=tail),
            }  # fmt: skip
    return out


def verl_batch(seed: int, rank: int) -> Any:
    """A TensorDict of right-padded samples as verl's workers hold them (attention_mask [B, S])."""
    from tensordict import TensorDict

    rng = np.random.default_rng([seed, rank])
    lengths = rng.integers(8, 1200, int(rng.integers(24, 40)))
    width = int(lengths.max())
    mask = torch.from_numpy(np.arange(width)[None, :] < lengths[:, None]).long()
    ids = torch.from_numpy(rng.integers(1, 1000, (len(lengths), width))) * mask
    return TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(lengths)])


def rearrange(seed: int, rank: int) -> dict[str, Any]:
    """verl's rearrange_micro_batches on this rank's batch, as verl ships it and patched."""
    import verl.utils.seqlen_balancing as sb

    import rolltool.integrations.verl as rv

    batch = verl_batch(seed, rank)
    cap = 4096
    results = {"batch": batch, "cap": cap}
    original = sb.get_seqlen_balanced_partitions
    for name in ("verl", "rolltool"):
        if name == "rolltool":
            results["patched"] = rv.patch()
        mbs, idx = sb.rearrange_micro_batches(batch, cap, dp_group=dist.group.WORLD)
        ours = sb.get_seqlen_balanced_partitions is rv.get_seqlen_balanced_partitions
        results[name] = {"micro_batches": mbs, "idx": idx, "rolltool's": ours}
    for module in results["patched"]:
        sys.modules[module].get_seqlen_balanced_partitions = original
    return results


def balance_batch(seed: int) -> dict[str, Any]:
    """verl's RayPPOTrainer._balance_batch on a DataProto (a trainer made without __init__: the
    method reads the dispatch info of the actor's worker group, here 4 workers on 2 DP ranks)."""
    from types import SimpleNamespace

    import verl.utils.seqlen_balancing as sb
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    import rolltool.integrations.verl as rv

    def batch() -> Any:
        b = verl_batch(seed, 9)
        n = len(b) // 2 * 2  # equal_size over 2 ranks
        return DataProto.from_dict(tensors={k: b[k][:n] for k in ("input_ids", "attention_mask")})

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": [0, 0, 1, 1]})
    results: dict[str, Any] = {"input": batch()}
    original = sb.get_seqlen_balanced_partitions
    for name in ("verl", "rolltool"):
        if name == "rolltool":
            results["patched"] = rv.patch()
        b, metrics = batch(), {}
        trainer._balance_batch(b, metrics)
        ours = ray_trainer.get_seqlen_balanced_partitions is rv.get_seqlen_balanced_partitions
        results[name] = {"batch": b, "metrics": metrics, "rolltool's": ours}
    for module in results["patched"]:
        sys.modules[module].get_seqlen_balanced_partitions = original
    return results


def resume(path: str, state_file: str) -> list[tuple[int, int, list[int]]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    state = torch.load(state_file, weights_only=False)
    ds = rolltool.open_packed(path)
    dataset = ds.torch_dataset(state["rank"], cp_rank=state["cp_rank"])
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=state["num_workers"])
    loader.load_state_dict(state["loader"])
    return [(int(b["step"]), int(b["micro_batch"]), b["input_ids"].tolist()) for b in loader]


def main(task: str, rank: int, world: int, port: int, out: Path, *args: str) -> None:
    if task == "resume":
        result: Any = resume(*args)
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
        if task == "ring":
            result = ring(rank, list(args))
        else:
            packs, seed = list(args[: args.index("--")]), int(args[-1])
            verl_on_cpu()
            result = {"ulysses": ulysses(packs), "rearrange": rearrange(seed, rank)}
            if rank == 0:
                result["balance_batch"] = balance_batch(seed)
        dist.barrier()
        dist.destroy_process_group()
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    task, rank, world, port, out, *rest = sys.argv[1:]
    main(task, int(rank), int(world), int(port), Path(out), *rest)
