"""The split backward of the zero-bubble schedules without doing the backward twice.

``I`` computes the stage input's gradient; ``W`` the parameters' gradients later.  The
plain way — ``I`` asks autograd for the input gradient, ``W`` runs the backward again
from the stage output restricted to the parameters — walks every activation gradient
twice: on the bench GPT, ``W`` cost more than a whole fused backward.

Note [weight seeds]
~~~~~~~~~~~~~~~~~~~
Call a node of the autograd graph *parameter-only* when everything below it ends in
parameters of this stage (``TBackward`` over a weight, an embedding looked up with
integer ids, the bias of an ``Addmm``).  A *weight node* is a node that is not
parameter-only with a parameter-only child: the op where an activation meets a weight
(``Addmm``, ``NativeLayerNorm``, ``Mm``).  The gradient of a parameter is a function of
the gradients arriving at its weight nodes only.  So ``I`` asks autograd, in the same
pass, for the stage input's gradient *and* for the gradient arriving at each weight
node (``GradientEdge`` inputs): autograd computes those along the way without running
the weight-gradient half of the ops (``x^T dy``) — nothing is needed below them but the
input path.  ``W`` then runs, per weight node, a backward from that node with its
captured gradient restricted to its own parameters: the op's weight half and the
parameter-only nodes under it, nothing else.

This is exact only if no parameter belongs to two weight nodes: a backward from one
would then also reach the other through the activation path and count it twice.  Such
graphs (a weight tied inside one stage, a parameter used by two ops) fall back to the
plain way, which is always right.  A root that is itself parameter-only (an output that
does not depend on the stage input) is seeded with its own gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.graph import GradientEdge

_ACCUMULATE = torch._C._functions.AccumulateGrad

__all__ = ["WeightSeeds", "plan_weight_seeds", "capture_input_and_seeds", "apply_weight_seeds"]

# (outputs, their gradients, the parameters to accumulate into) for one backward in W.
WeightSeeds = list[tuple[list, list, list[torch.Tensor]]]


def plan_weight_seeds(roots: list[torch.Tensor], params: dict[int, torch.Tensor]) -> Optional[tuple[list, list]]:
    """The weight nodes under ``roots`` (see Note [weight seeds]): ``(edges, owners)``
    where ``edges`` are the gradient edges to capture and ``owners`` says, per weight
    node or parameter-only root, which edges (or root index) and parameters it seeds.
    None when the split would not be exact (a parameter under two weight nodes)."""
    below: dict = {}  # node -> frozenset of parameter ids under it when parameter-only, else None
    kids: dict = {}  # node -> its children (next_functions builds a tuple on every access)
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    weight_nodes = []
    while stack:  # post-order: a node is settled once its children are
        node = stack[-1]
        if node in below:
            stack.pop()
            continue
        if type(node) is _ACCUMULATE:
            below[node] = frozenset((id(node.variable),)) if id(node.variable) in params else None
            stack.pop()
            continue
        children = kids.get(node)
        if children is None:
            children = kids[node] = [c for c, _ in node.next_functions if c is not None]
            todo = [c for c in children if c not in below]
            if todo:
                stack.extend(todo)
                continue
        stack.pop()
        sets = [below[c] for c in children]
        if children and None not in sets:
            below[node] = frozenset().union(*sets)
            continue
        below[node] = None
        owned = [s for s in sets if s is not None]
        if owned:
            weight_nodes.append((node, frozenset().union(*owned)))
    edges, owners = [], []
    for node, ids in weight_nodes:
        count = len(getattr(node, "_input_metadata", (None,)))
        owners.append(("edges", list(range(len(edges), len(edges) + count)), ids))
        edges += [GradientEdge(node, k) for k in range(count)]
    for i, r in enumerate(roots):
        ids = None
        if r.grad_fn is not None and below.get(r.grad_fn) is not None:
            ids = below[r.grad_fn]
        elif r.grad_fn is None and id(r) in params:
            ids = frozenset((id(r),))
        if ids is not None:
            owners.append(("root", i, ids))
    owned = [ids for *_, ids in owners]
    if sum(map(len, owned)) != len(frozenset().union(*owned)):
        return None  # a parameter under two weight nodes: not exact (Note [weight seeds])
    return edges, owners


def capture_input_and_seeds(roots: list, grads: Optional[list], inp: list[torch.Tensor],
                            params: dict[int, torch.Tensor]) -> Optional[tuple[list, WeightSeeds]]:
    """``I``: the input gradients and the weight seeds, in one backward pass; None when
    the split would not be exact (then the caller takes the plain way)."""
    plan = plan_weight_seeds(roots, params)
    if plan is None:
        return None
    edges, owners = plan
    got = torch.autograd.grad(roots, list(inp) + edges, grads, retain_graph=True, allow_unused=True)
    grad_in, captured = got[:len(inp)], got[len(inp):]
    seeds: WeightSeeds = []
    for kind, where, ids in owners:
        targets = [params[i] for i in ids]
        if kind == "root":
            g = grads[where] if grads is not None else None
            seeds.append(([roots[where]], [g], targets))
            continue
        pairs = [(edges[k], captured[k]) for k in where if captured[k] is not None]
        if pairs:
            seeds.append(([e for e, _ in pairs], [g for _, g in pairs], targets))
    return list(grad_in), seeds


def apply_weight_seeds(seeds: WeightSeeds) -> None:
    """``W``: accumulate each seed's parameter gradients (the graph is kept: seeds may
    share parameter-only nodes; it is released when the slot drops it)."""
    for outputs, grads, params in seeds:  # a None gradient: a scalar loss root
        torch.autograd.backward(outputs, grads, inputs=params, retain_graph=True)
