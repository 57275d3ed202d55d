"""ZeRO-1 under the pipeline: a rank's replicas split its stages' optimizer state.

Note [ZeRO-1 sharding]
With ``Pipeline(..., dp=D, zero=1)`` each parameter of a rank's stages is *owned* by one of
the rank's ``D`` replicas; the owner alone holds its optimizer state and steps it.

* What is sharded: whole parameters, balanced by bytes (largest first, each to the replica
  with the fewest bytes so far, ties to the lowest replica), over all the stages of the
  actor together.  Whole parameters keep every per-tensor optimizer exact (LAMB's trust
  ratio, Adafactor's factored moments, Muon's orthogonalisation read a whole matrix), the
  optimizer state stays keyed by parameter (so checkpoints reshard by renaming, never by
  slicing), and the user's optimizer factory still sees the stage's whole parameter list:
  it is called on all of them (its param groups, built by position or by shape, are the
  same as with ``zero=0``), then each group keeps the parameters this replica owns (and
  the state it made eagerly, Adagrad's sums, only theirs).  Flat slices would balance to the
  byte but keep only elementwise optimizers (SGD, Adam, AdamW) exact.  The price: a stage
  whose bytes sit in a few large tensors (an embedding) balances coarsely; ``bench memory``
  shows how far from ``1/D`` it lands.  An optimizer whose step couples parameters
  (``torch.optim.LBFGS`` flattens them all) cannot be split this way and is refused.
* Gradients: by the stage's ``ALLREDUCE`` (after its last backward; the buckets start
  inside that backward, Note [overlapped dp reduction] in actors/dp_reduce.py) the gradients
  of the parameters that no tie shares are reduce-scattered (mean) over the rank's
  data-parallel group, in buckets of ``bucket_bytes`` laid out owner after owner
  (``dist.reduce_scatter`` with one segment per owner; gloo has it); a replica keeps the
  gradients it owns and drops the others at once.  A tied parameter's gradient is all-reduced whole instead: the tie's
  sum (``TIE_REDUCE``, later in the program) adds copies that different replicas own.
* The update (Note [agreed update]): the global norm and the non-finite flag come from the
  owned gradients only, so each element counts once over the replicas (no ``/ dp``); the
  owners step, then every parameter is all-gathered from its owner, bucket by bucket (gloo's
  ``all_gather`` refuses unequal parts, so each owner's part is padded to the bucket's
  largest: one collective per bucket, not one broadcast per owner).  A skipped step
  gathers nothing: no replica changed anything.
* Context parallelism (``cp > 1``): the ``D`` that shares the state is the rank's ``dp x cp``
  actors, the group that averages its gradients (Note [device grid] in actors/grid.py); an
  actor's index in it (``DeviceGrid.reduce_index``) is its owner index and names its shard's
  checkpoint file.  Sharding over ``dp`` alone, the CP ranks of a replica holding copies, would
  be as exact (after the average every member holds the same gradients) but costs more: an
  all-reduce over each CP group and a reduce-scatter and all-gather over new dp-only groups,
  where the one ``dp x cp`` group's reduce-scatter and all-gather serve as they are.  Each CP
  rank holds ``1/(dp x cp)`` of the state; checkpoints merge the shards by name, so a
  checkpoint at ``cp=2, zero=1`` loads at any cp, dp and zero (Note [resharding] in
  mpmd/training/checkpoint.py).
* Expert parameters (``ep > 1``, Note [expert parallelism] in actors/grid.py) are sharded over
  the EP group already: each replica owns (steps and keeps the state of) its own experts, and
  only the dense parameters are assigned owners, reduce-scattered and gathered.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .buckets import bucket_tensors
from .comm import Communicator
from .tensor_parallel import align_grads, local

__all__ = ["build_optimizers", "average_gradients", "assign_owners", "shard_optimizer", "ZeroStage", "reduce_scatter_mean",
           "start_scatter", "PendingScatter", "gather_from_owners", "named_state", "merge_named", "positional_state",
           "refuse_unshardable"]


def assign_owners(sizes: list[int], dp: int) -> list[int]:
    """The replica owning each of the parameters of ``sizes`` bytes (Note [ZeRO-1 sharding])."""
    load = [0] * dp
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        d = min(range(dp), key=lambda d: (load[d], d))
        owners[i] = d
        load[d] += sizes[i]
    return owners


def refuse_unshardable(opt: torch.optim.Optimizer) -> None:
    if isinstance(opt, torch.optim.LBFGS):
        raise ValueError("zero=1 shards the optimizer by whole parameters, but LBFGS updates all parameters as "
                         "one flat vector (its step couples them), so a shard cannot step alone; use zero=0 with "
                         "LBFGS, or an optimizer that updates each parameter from its own gradient and state")


class ZeroStage:
    """One stage's parameters on one actor under ``zero=1``: their names, owners, and the order
    (per group) of the full optimizer the factory built, before it kept only the owned ones."""

    def __init__(self, module: torch.nn.Module, owners: dict[int, int], replica: int, tied: frozenset,
                 experts: frozenset = frozenset()) -> None:
        self.tied = tied  # ids of the parameters a tie shares: their gradients are all-reduced whole
        self.names = {id(p): n for n, p in module.named_parameters()}
        # the dense parameters: owned by one replica each (an expert one is its own replica's)
        self.params = [p for p in module.parameters() if id(p) not in experts]
        self.owner = {id(p): owners[id(p)] for p in self.params}
        self.replica = replica
        self.full_order: list[list[str]] = []  # per param group of the full optimizer: parameter names

    def owns(self, p: torch.Tensor) -> bool:
        return self.owner.get(id(p), self.replica) == self.replica

    def shard(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``opt`` (built on every parameter) keeping only the owned ones (Note [ZeRO-1 sharding])."""
        refuse_unshardable(opt)
        self.full_order = [[self.names[id(p)] for p in g["params"]] for g in opt.param_groups]
        for g in opt.param_groups:
            g["params"] = [p for p in g["params"] if self.owns(p)]
        for p in [p for p in opt.state if not self.owns(p)]:
            del opt.state[p]
        return opt

    def owner_major(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` ordered owner after owner (stable), as every replica orders them alike."""
        return sorted(params, key=lambda p: self.owner[id(p)])


def build_optimizers(modules: dict[int, torch.nn.Module], factory: Optional[Callable], replica: int, dp: int,
                     zero: int, tied_ids: set[int], expert_ids: frozenset = frozenset()) -> tuple[dict, dict]:
    """``(stage -> optimizer, stage -> ZeroStage)`` for one actor's stages: one optimizer per
    stage (``factory`` on its parameters); under ``zero=1`` a shard of it, else no ZeroStage.
    ``expert_ids``: the expert parameters, which ZeRO-1 leaves to their own replica."""
    if zero:
        return shard_optimizer(modules, factory, replica, dp, tied_ids, expert_ids)
    return {s: factory(list(modules[s].parameters())) for s in sorted(modules)
            if factory is not None and list(modules[s].parameters())}, {}


def shard_optimizer(modules: dict[int, torch.nn.Module], factory: Callable, replica: int, dp: int,
                    tied_ids: set[int], expert_ids: frozenset = frozenset()) -> tuple[dict, dict]:
    """``(stage -> sharded optimizer, stage -> ZeroStage)`` for one actor's stages."""
    params = [p for s in sorted(modules) for p in modules[s].parameters() if id(p) not in expert_ids]
    sizes = [local(p).numel() * p.element_size() for p in params]  # this actor's part (Note [tensor parallelism])
    owners = dict(zip((id(p) for p in params), assign_owners(sizes, dp)))
    stages, optimizers = {}, {}
    for s in sorted(modules):
        zs = stages[s] = ZeroStage(modules[s], owners, replica, frozenset(tied_ids), frozenset(expert_ids))
        if factory is not None and zs.params:
            optimizers[s] = zs.shard(factory(list(modules[s].parameters())))
    return optimizers, stages


def average_gradients(comm: Communicator, module: torch.nn.Module, zs: Optional["ZeroStage"],
                      bucket_bytes: int, expert_ids: frozenset = frozenset()) -> None:
    """A stage's ``ALLREDUCE``: its dense gradients averaged over the replicas, all-reduced (``zs``
    is None: zero=0) or reduce-scattered (``reduce_scatter_mean``); ``expert_ids``' are not here
    (``average_experts`` in actors/dp_reduce.py)."""
    align_grads(module.parameters())  # under TP: local parts are this actor's shards (Note [tensor parallelism])
    if zs is not None:
        reduce_scatter_mean(comm, zs, bucket_bytes)
        return
    comm.allreduce_mean([local(p.grad) for p in module.parameters() if p.grad is not None and id(p) not in expert_ids],
                        bucket_bytes)


def reduce_scatter_mean(comm: Communicator, zs: ZeroStage, bucket_bytes: int) -> None:
    """Stage ``zs``'s gradients averaged over the replicas (Note [ZeRO-1 sharding]): tied ones
    whole on every replica, the others only on their owner (the rest dropped)."""
    with_grad = [p for p in zs.params if p.grad is not None]
    tied = [local(p.grad) for p in with_grad if id(p) in zs.tied]
    comm.allreduce_mean(tied, bucket_bytes)
    rest = zs.owner_major([p for p in with_grad if id(p) not in zs.tied])
    if comm.dp_group is None:
        return
    for bucket in bucket_tensors(rest, bucket_bytes):
        start_scatter(comm, zs, bucket).wait()


def start_scatter(comm: Communicator, zs: ZeroStage, bucket: list[torch.Tensor]) -> "PendingScatter":
    """Start the reduce-scatter (mean) of one bucket of untied parameters of stage ``zs``,
    ordered owner after owner (Note [ZeRO-1 sharding]); its ``wait`` ends it."""
    flat = torch.cat([local(p.grad).reshape(-1) for p in bucket])
    (wire,) = comm.to_wire([flat])
    segments = _segments(wire, bucket, zs, comm.dp_size)
    mine = torch.empty_like(segments[zs.replica])
    work = dist.reduce_scatter(mine, segments, group=comm.dp_group, async_op=True)
    return PendingScatter(work, comm, zs, bucket, mine, segments)


class PendingScatter:
    """One bucket's reduce-scatter under way: ``wait`` waits for it, gives the owned gradients
    the replicas' mean and drops the others."""

    def __init__(self, work, comm: Communicator, zs: ZeroStage, bucket: list[torch.Tensor], mine: torch.Tensor,
                 segments: list[torch.Tensor]) -> None:
        self.work, self.comm, self.zs, self.bucket = work, comm, zs, bucket
        self.mine, self.segments = mine, segments  # held until the collective is done

    def wait(self) -> None:
        self.work.wait()
        mine = self.comm.from_wire([self.mine])[0].div_(self.comm.dp_size)
        offset = 0
        for p in self.bucket:
            if self.zs.owns(p):
                g = local(p.grad)
                g.copy_(mine[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            else:
                p.grad = None


def gather_from_owners(comm: Communicator, zs: ZeroStage, bucket_bytes: int) -> None:
    """Every replica gets every parameter of stage ``zs`` as its owner stepped it (the all-gather)."""
    if comm.dp_group is None:
        return
    params = zs.owner_major([p for p in zs.params if p.requires_grad])
    for bucket in bucket_tensors(params, bucket_bytes):
        flat = torch.cat([local(p).detach().reshape(-1) for p in bucket])
        (wire,) = comm.to_wire([flat])
        segments = _segments(wire, bucket, zs, comm.dp_size)
        # gloo has no all-gather of unequal parts: each part padded to the largest, one collective
        # per bucket instead of one broadcast per owner (dp latencies); padding moves at most the imbalance.
        width = max(s.numel() for s in segments)
        parts = [wire.new_empty(width) for _ in segments]
        mine = wire.new_zeros(width)
        mine[:segments[zs.replica].numel()].copy_(segments[zs.replica])
        dist.all_gather(parts, mine, group=comm.dp_group)
        for segment, part in zip(segments, parts):
            segment.copy_(part[:segment.numel()])
        flat = comm.from_wire([wire])[0]
        offset = 0
        with torch.no_grad():
            for p in bucket:
                dest = local(p)
                if not zs.owns(p):
                    dest.copy_(flat[offset:offset + dest.numel()].view_as(dest))
                offset += dest.numel()


def _segments(flat: torch.Tensor, bucket: list, zs: ZeroStage, dp: int) -> list[torch.Tensor]:
    """``flat``'s views, one per replica: the bytes of the bucket's parameters it owns (maybe none)."""
    sizes = [0] * dp
    for p in bucket:
        sizes[zs.owner[id(p)]] += local(p).numel()
    return list(flat.split(sizes))


# -- optimizer state by parameter name (checkpoints that reshard) ---------------------------------
def named_state(opt_state: dict, order: list[list[str]]) -> dict:
    """An optimizer ``state_dict`` (positional) as ``{"state": {name: ...}, "param_groups":
    [{hyperparameters, "params": [names]}]}``, ``order`` naming its parameters per group."""
    flat = [n for group in order for n in group]
    groups = []
    for g, names in zip(opt_state["param_groups"], order, strict=True):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(names)})
    state = {flat[i]: v for i, v in opt_state["state"].items()}
    return {"state": state, "param_groups": groups}


def merge_named(shards: list[dict]) -> dict:
    """The named states of a stage's shards as one (hyperparameters from the first)."""
    state: dict = {}
    for sh in shards:
        state.update(sh["state"])
    groups = [dict(g, params=[n for sh in shards for n in sh["param_groups"][i]["params"]])
              for i, g in enumerate(shards[0]["param_groups"])]
    return {"state": state, "param_groups": groups}


def positional_state(named: dict, order: list[list[str]]) -> dict:
    """A named state as the positional ``state_dict`` of an optimizer whose groups hold the
    parameters ``order`` names (a shard keeps the state of its own parameters only)."""
    if len(named["param_groups"]) != len(order):
        raise ValueError(f"the checkpoint's optimizer has {len(named['param_groups'])} parameter groups, this "
                         f"optimizer {len(order)}; build the optimizer the checkpoint was written with")
    index, groups, i = {}, [], 0
    for g, names in zip(named["param_groups"], order, strict=True):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + len(names)))})
        for n in names:
            index[n] = i
            i += 1
    return {"state": {index[n]: v for n, v in named["state"].items() if n in index}, "param_groups": groups}

