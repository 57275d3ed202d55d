"""The cost model: what each action of a schedule costs (semantics in DESIGN.md,
"Simulator semantics", and Note [runtime costs]).

Note [runtime costs]
--------------------
The compute costs ``f``, ``b``, ``w`` (and the flat ``comm`` hop, ``tie``) describe the
schedule alone.  The other fields charge what the runtime pays around them; all default
to nothing, so a ``Costs`` without them simulates exactly as before:

* ``task``: rank time to start one instruction (dispatch inside the actor's loop);
  every instruction of a lowered schedule pays it (of a compute-only one: each compute);
* ``message``: rank time of one message at each end (posting a send, completing a
  receive: copy-in, wake-up); ``send``, when set, replaces it at the sending end (posting
  a send on a loaded machine has a long tail that completing a receive does not: the
  calibrated ``send`` is the sends' mean, ``message`` the ready receives' median);
* a transfer takes ``latency + bytes / bandwidth`` (``links[(src, dst)]`` overrides the
  pair), ``bytes`` the activation leaving stage ``s`` (``activation_bytes[s]``; its
  gradient coming back is as large);
* ``prefetch``: how many receives ahead a rank posts (``irecv``); a posted receive's
  transfer starts when the send is posted, so it overlaps the receiver's compute; an
  unposted one starts only when the receiver reaches it (a rendezvous);
* ``launch[r]``: when rank ``r`` starts its program after the step is issued (the
  step's message reaching it, its inputs unpacked); ``optimizer[r]``: rank ``r``'s
  optimizer step after its program; ``step_overhead``: what the step costs after the
  last rank ends (collecting the results);
* ``dp``: the replicas of each rank that average their gradients; with ``dp > 1`` stage
  ``s``'s ``ALLREDUCE`` holds its rank ``allreduce_latency[s] + 2 (dp - 1) / dp *
  grad_bytes[s] / allreduce_bandwidth`` (``Costs.allreduce``): a ring all-reduce moves
  ``2 (dp - 1) / dp`` times the gradient through each replica; the latency part is per
  stage (its buckets' fixed costs differ).  Replicas run one program, so the simulated
  rank stands for all of them (a replica that arrives first waits for the others: the
  calibrated value is the replicas' mean, which holds that wait).  With ``dp == 1`` the
  runtime's ``ALLREDUCE`` only starts (``task``).
* ``zero=1`` (ZeRO-1, Note [ZeRO-1 sharding] in actors/zero.py): the ``ALLREDUCE`` is a
  reduce-scatter, ``(dp - 1) / dp`` times the gradient through each replica, and after its
  optimizer step each rank all-gathers its stages' parameters, ``allreduce_latency[s] +
  (dp - 1) / dp * grad_bytes[s] / allreduce_bandwidth`` per stage (``Costs.allgather``).
* ``overlap_reduce`` (Note [overlapped dp reduction] in actors/dp_reduce.py): the runtime
  starts each bucket of stage ``s``'s gradients inside its last backward (``B``, or ``W``
  when split), so the ring's transfer, ``allreduce(s) - allreduce_latency[s]``, runs beside
  the rank's work from that backward's start ``began``; the ``ALLREDUCE``, reached at
  ``t``, ends at ``max(t, began + transfer) + allreduce_latency[s]`` (``allreduce_end``):
  only the transfer the backward did not cover, and the fixed costs, are exposed.  A fluid
  model: it lets the transfer begin with the backward, while the first bucket is final
  only some way into it and the last only at its end (optimistic by about one bucket's
  transfer, ``bucket_bytes`` of it, when the transfer outlasts the backward).  Calibrated
  from the exposed ``ALLREDUCE`` slices against their windows (mpmd/profiler/calibrate.py).
* ``tp`` (tensor parallelism inside a stage, Megatron-style): each pipeline rank is ``tp``
  devices holding a sharded stage; the simulated rank stands for all of them (they run in
  lockstep).  ``f``, ``b``, ``w`` stay the whole stage's (one device's) costs and
  ``tp_sharded[s]`` is the share of them the sharded layers take: a rank computes
  ``(1 - p + p / tp)`` of each (norms, residuals, un-shardable modules stay whole).
  Stage ``s``'s forward also runs ``tp_forward[s]`` all-reduces of ``tp_bytes[s]`` (one
  microbatch's activation, batch x seq x hidden) and its input-gradient backward (``I``,
  or inside ``B``) ``tp_backward[s]`` (None: as many as the forward): 2 and 2 per sharded
  transformer layer (after attention's and the MLP's row-parallel projections; in the
  backward the column-parallel ones' input gradients), 1 and 0 for a vocabulary-parallel
  embedding.  ``W`` needs none: a weight gradient is local to its shard.  A collective
  is a ring all-reduce, ``tp_latency + 2 (tp - 1) / tp * tp_bytes[s] / tp_bandwidth``
  (``Costs.tp_collective``), and holds the rank (no overlap with compute).  Left out:
  sequence parallelism (reduce-scatter + all-gather instead, norms sharded too), the LM
  head's logits all-gather, and overlapping the collectives with compute.  The stage
  boundary is not sharded: every TP rank sends the whole activation to its counterpart
  (``tp`` parallel links), so ``activation_bytes`` and the transfers are unchanged.
  With ``tp == 1`` (the default) nothing of this is charged: costs are the same, bit for bit.

Note [all-to-all costs]
-----------------------
A stage with experts spread over expert-parallel ranks exchanges tokens with them inside
its forward (counts, dispatch, combine) and inside its input-gradient backward (their
gradients, in ``I`` or inside ``B``); ``W`` exchanges nothing (an expert's weight gradient
is local to its shard).  ``a2a_f[s]`` and ``a2a_b[s]`` are the seconds a rank waits on those
exchanges in one forward and one backward of stage ``s`` (default 0: no experts), so alone
an ``F`` costs ``f + a2a_f`` and a backward its compute plus ``a2a_b``: ``f``, ``b``, ``w``,
``fused`` are compute alone.  An ``OVERLAP`` (Note [overlapped forward and backward] in
actions.py) computes one part at a time, so it costs both parts' computes, and each
part's exchanges are in flight while the other part computes: it hides
``min(a2a of one part, compute of the other part)`` each way (``Costs.hidden_a2a``) and
exposes the rest (``Costs.exposed_a2a``).  A fluid model: it lets the other part's compute
cover an exchange wherever the exchange falls, while the actor hands over only at the
exchanges, so a part whose compute is all before its first exchange hides less.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence, Union

from .actions import Action, Kind

__all__ = ["Costs", "Link", "PerStage"]

PerStage = Union[float, Sequence[float]]


class Link(tuple):
    """``(latency seconds, bandwidth bytes/second)`` of one direction between two ranks."""

    def __new__(cls, latency: float, bandwidth: float) -> "Link":
        return super().__new__(cls, (float(latency), float(bandwidth)))

    def __getnewargs__(self) -> tuple[float, float]:  # pickle (Ray ships costs) calls __new__ with these
        return tuple(self)

    @property
    def latency(self) -> float:
        return self[0]

    @property
    def bandwidth(self) -> float:
        return self[1]

    def seconds(self, nbytes: float) -> float:
        return self[0] + (nbytes / self[1] if nbytes and math.isfinite(self[1]) else 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """Per (virtual) stage, per microbatch costs; a float or one value per stage.

    A split backward costs ``b`` (``I``) and ``w`` (``W``); a fused one (``B``) ``fused``,
    or ``b + w`` when None (one autograd pass costs less than two: the calibrated costs
    measure both where a stage runs both, Note [fused where free] in fuse.py).  The
    runtime terms: Note [runtime costs].
    """

    f: PerStage = 1.0
    b: PerStage = 1.0
    w: PerStage = 1.0
    fused: Optional[PerStage] = None  # per stage, a fused backward B (None: b + w)
    comm: float = 0.0
    tie: float = 0.0  # one tie reduction across ranks (Note [tie reduction] in passes.py)
    task: float = 0.0
    message: float = 0.0
    send: Optional[float] = None  # rank time to post one send (None: ``message``)
    latency: float = 0.0
    bandwidth: float = math.inf
    activation_bytes: PerStage = 0.0
    links: Mapping = dataclasses.field(default_factory=dict)  # (src rank, dst rank) -> Link
    prefetch: int = 0
    launch: PerStage = 0.0  # per rank
    optimizer: PerStage = 0.0  # per rank
    step_overhead: float = 0.0
    dp: int = 1  # replicas per rank averaging gradients (the ALLREDUCE group)
    grad_bytes: PerStage = 0.0  # per stage, the gradient bytes its ALLREDUCE averages
    allreduce_latency: PerStage = 0.0  # per stage, the fixed seconds of its ALLREDUCE
    allreduce_bandwidth: float = math.inf  # bytes/second a replica moves in the ring
    zero: int = 0  # 1: the ALLREDUCE reduce-scatters and the optimizer step all-gathers (ZeRO-1)
    overlap_reduce: bool = False  # the ALLREDUCE's transfer runs beside the stage's last backward
    tp: int = 1  # devices each stage is sharded over (tensor parallelism; Note [runtime costs])
    tp_sharded: PerStage = 1.0  # per stage, the share of f, b, w that the TP shards divide by tp
    tp_forward: PerStage = 0.0  # per stage, TP all-reduces in one forward (2 per sharded transformer layer)
    tp_backward: Optional[PerStage] = None  # per stage, in one input-gradient backward (None: tp_forward)
    tp_bytes: PerStage = 0.0  # per stage, the bytes one TP all-reduce moves (a microbatch's activation)
    tp_latency: float = 0.0  # fixed seconds of one TP all-reduce
    tp_bandwidth: float = math.inf  # bytes/second a TP rank moves in the ring
    a2a_f: PerStage = 0.0  # per stage, seconds of expert all-to-all in one forward (Note [all-to-all costs])
    a2a_b: PerStage = 0.0  # per stage, seconds of expert all-to-all in one input-gradient backward (I or B)

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "activation_bytes", "launch", "optimizer", "grad_bytes", "allreduce_latency",
                     "tp_forward", "tp_backward", "tp_bytes", "a2a_f", "a2a_b"):
            vals = self.values(name)
            if any(not math.isfinite(v) or v < 0 for v in vals):
                raise ValueError(f"Costs.{name} must be finite and >= 0, got {getattr(self, name)!r}")
        for name in ("comm", "tie", "task", "message", "latency", "step_overhead", "tp_latency"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"Costs.{name} must be finite and >= 0, got {getattr(self, name)!r}")
        if self.fused is not None and any(not math.isfinite(v) or v < 0 for v in self.values("fused")):
            raise ValueError(f"Costs.fused must be None (b + w) or finite and >= 0, got {self.fused!r}")
        if self.send is not None and not (math.isfinite(self.send) and self.send >= 0):
            raise ValueError(f"Costs.send must be None (as message) or finite and >= 0, got {self.send!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"Costs.bandwidth must be > 0 bytes/s (math.inf: free), got {self.bandwidth!r}")
        if not self.allreduce_bandwidth > 0:
            raise ValueError(f"Costs.allreduce_bandwidth must be > 0 bytes/s (math.inf: free), "
                             f"got {self.allreduce_bandwidth!r}")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ValueError(f"Costs.tp must be an int >= 1 (devices per stage), got {self.tp!r}")
        if any(not 0.0 <= v <= 1.0 for v in self.values("tp_sharded")):
            raise ValueError(f"Costs.tp_sharded must be shares in [0, 1], got {self.tp_sharded!r}")
        if not self.tp_bandwidth > 0:
            raise ValueError(f"Costs.tp_bandwidth must be > 0 bytes/s (math.inf: free), got {self.tp_bandwidth!r}")
        if self.zero not in (0, 1):
            raise ValueError(f"Costs.zero must be 0 or 1, got {self.zero!r}")
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"Costs.dp must be an int >= 1 (replicas per rank), got {self.dp!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"Costs.prefetch must be an int >= 0 (receives posted ahead), got {self.prefetch!r}")
        links = {}
        for pair, link in dict(self.links).items():
            lat, bw = link
            if len(pair) != 2 or not (math.isfinite(lat) and lat >= 0 and bw > 0):
                raise ValueError(f"Costs.links[{pair!r}] must be (latency >= 0, bandwidth > 0), got {link!r}")
            links[(int(pair[0]), int(pair[1]))] = Link(lat, bw)
        object.__setattr__(self, "links", links)

    def __hash__(self) -> int:  # links is a dict: hash its items
        return hash(tuple(tuple(sorted(self.links.items())) if f.name == "links" else getattr(self, f.name)
                          for f in dataclasses.fields(self)))

    def values(self, name: str) -> tuple[float, ...]:
        """The per-stage values of ``"f"``, ``"b"``, ``"w"``, ``"activation_bytes"``,
        ``"grad_bytes"``, ``"allreduce_latency"``, the ``"tp_*"`` terms or per
        rank of ``"launch"``, ``"optimizer"`` (one value: every stage or rank)."""
        if name == "tp_backward" and self.tp_backward is None:
            name = "tp_forward"
        v = getattr(self, name)
        return (float(v),) if isinstance(v, (int, float)) else tuple(float(x) for x in v)

    def at(self, name: str, index: int) -> float:
        vals = self.values(name)
        if len(vals) == 1:
            return vals[0]
        if index >= len(vals):
            what = "rank" if name in ("launch", "optimizer") else "stage"
            raise ValueError(f"Costs.{name} has {len(vals)} values but the schedule has {what} {index}")
        return vals[index]

    @property
    def charges_runtime(self) -> bool:
        """Whether any runtime term (Note [runtime costs]) is set."""
        return bool(self.task or self.message or self.send or self.latency or math.isfinite(self.bandwidth) or self.links
                    or self.prefetch or any(self.values("optimizer")) or any(self.values("launch"))
                    or self.step_overhead or self.charges_allreduce)

    @property
    def charges_allreduce(self) -> bool:
        """Whether an ``ALLREDUCE`` costs more than ``task`` (``dp > 1`` and a term set)."""
        return self.dp > 1 and (any(self.values("allreduce_latency"))
                                or (any(self.values("grad_bytes")) and math.isfinite(self.allreduce_bandwidth)))

    @property
    def send_message(self) -> float:
        """Rank time to post one send: ``send``, or ``message`` when it is not set."""
        return self.message if self.send is None else self.send

    def allreduce(self, stage: int) -> float:
        """Seconds stage ``stage``'s data-parallel ``ALLREDUCE`` holds its rank, beyond ``task``."""
        return self._ring(stage, 1.0 if self.zero else 2.0)

    def allreduce_end(self, stage: int, began: float, at: float) -> float:
        """When stage ``stage``'s ``ALLREDUCE``, reached at ``at``, lets its rank go on, the
        stage's last backward having begun at ``began``: ``at + allreduce(stage)``, or under
        ``overlap_reduce`` only what that backward did not cover (Note [runtime costs])."""
        if not self.overlap_reduce or self.dp <= 1:
            return at + self.allreduce(stage)
        fixed = self.at("allreduce_latency", stage)
        return max(at, began + self.allreduce(stage) - fixed) + fixed

    def allgather(self, stage: int) -> float:
        """Seconds ZeRO-1's all-gather of stage ``stage``'s parameters holds its rank after the
        optimizer step (0 without ``zero``)."""
        return self._ring(stage, 1.0) if self.zero else 0.0

    def _ring(self, stage: int, passes: float) -> float:
        if self.dp <= 1:
            return 0.0
        ring = passes * (self.dp - 1) / self.dp * self.at("grad_bytes", stage)
        moved = ring / self.allreduce_bandwidth if ring and math.isfinite(self.allreduce_bandwidth) else 0.0
        return self.at("allreduce_latency", stage) + moved

    def tp_collective(self, stage: int, backward: bool = False) -> float:
        """Seconds of the TP all-reduces in one forward of ``stage`` (``backward``: in one
        input-gradient backward); 0 with ``tp == 1``.  Note [runtime costs]."""
        if self.tp <= 1:
            return 0.0
        count = self.at("tp_backward" if backward else "tp_forward", stage)
        if not count:
            return 0.0
        ring = 2.0 * (self.tp - 1) / self.tp * self.at("tp_bytes", stage)
        moved = ring / self.tp_bandwidth if ring and math.isfinite(self.tp_bandwidth) else 0.0
        return count * (self.tp_latency + moved)

    def of(self, action: Action) -> float:
        """The compute cost of ``action`` (0 for anything else); with ``tp > 1`` one TP
        rank's share of it plus its TP all-reduces (Note [runtime costs]); plus its expert
        all-to-alls, of an OVERLAP those its parts do not hide (Note [all-to-all costs])."""
        if action.parts is not None:
            return sum(self._compute(p) for p in action.parts) + self.exposed_a2a(action)
        return self._compute(action) + self.a2a(action)

    def a2a(self, action: Action) -> float:
        """Seconds of expert all-to-all inside one ``F`` (``a2a_f``), ``B`` or ``I`` (``a2a_b``);
        of an OVERLAP its parts' sum; 0 for anything else (Note [all-to-all costs])."""
        if action.parts is not None:
            return sum(self.a2a(p) for p in action.parts)
        if action.kind is Kind.F:
            return self.at("a2a_f", action.stage)
        if action.kind in (Kind.B, Kind.I):
            return self.at("a2a_b", action.stage)
        return 0.0

    def hidden_a2a(self, action: Action) -> float:
        """Of an OVERLAP, the all-to-all seconds each part hides behind the other's compute;
        0 for anything else (Note [all-to-all costs])."""
        if action.parts is None:
            return 0.0
        fwd, bwd = action.parts
        return min(self.a2a(fwd), self._compute(bwd)) + min(self.a2a(bwd), self._compute(fwd))

    def exposed_a2a(self, action: Action) -> float:
        """The all-to-all seconds ``action`` waits on: ``a2a`` less ``hidden_a2a``."""
        return self.a2a(action) - self.hidden_a2a(action)

    def _compute(self, action: Action) -> float:
        """A single action's compute, without its all-to-alls."""
        k, s = action.kind, action.stage
        if self.tp > 1:
            return self._of_sharded(k, s)
        if k is Kind.F:
            return self.at("f", s)
        if k is Kind.B:
            return self.backward(s)
        if k is Kind.I:
            return self.at("b", s)
        if k is Kind.W:
            return self.at("w", s)
        return 0.0

    def backward(self, stage: int) -> float:
        """A fused backward of ``stage``: ``fused``, else ``b + w``."""
        return self.at("fused", stage) if self.fused is not None else self.at("b", stage) + self.at("w", stage)

    def _of_sharded(self, k: Kind, s: int) -> float:
        p = self.at("tp_sharded", s)
        share = 1.0 - p + p / self.tp
        if k is Kind.F:
            return self.at("f", s) * share + self.tp_collective(s)
        if k is Kind.B:
            return self.backward(s) * share + self.tp_collective(s, backward=True)
        if k is Kind.I:
            return self.at("b", s) * share + self.tp_collective(s, backward=True)
        if k is Kind.W:
            return self.at("w", s) * share
        return 0.0

    def transfer(self, src: int, dst: int, boundary: int) -> float:
        """Seconds on the wire for the message across stage boundary ``boundary`` (between
        stages ``boundary`` and ``boundary + 1``) from rank ``src`` to rank ``dst``, plus ``comm``."""
        link = self.links.get((src, dst), Link(self.latency, self.bandwidth))
        return self.comm + link.seconds(self.at("activation_bytes", boundary))
