"""Expert tensors as pieces of the whole (Note [expert pieces] in actors/expert_state.py), in one
process: written by EP ranks, merged and cut back for another ep, through real part files."""

from __future__ import annotations

import pytest
import torch

from actors.checkpoint_io import Where, part_file, read_shard, write_shard
from actors.expert_state import (ExpertBox, cut_experts, cut_named_state, cut_to_box, expert_boxes, expert_pieces,
                                 split_expert_optimizer, whole_shapes, whole_state, without_experts)
from actors.pieces import merge_parts, part_of

E, I, H = 4, 3, 2


def box(first: int, local: int) -> ExpertBox:
    return ExpertBox([first, 0, 0], [local, I, H], [E, I, H])


def ranks_of(ep: int) -> list[ExpertBox]:
    return [box(r * E // ep, E // ep) for r in range(ep)]


def written(whole: torch.Tensor, ep: int) -> list[dict]:
    """What EP ranks 0..ep-1 write of a stage holding ``whole`` as "w" plus a dense "b"."""
    parts = []
    for r, b in enumerate(ranks_of(ep)):
        state = expert_pieces({"w": whole[r * E // ep:(r + 1) * E // ep].clone(), "b": torch.ones(2)}, {"w": b})
        parts.append({0: state} if r == 0 else {0: part_of(state)})
    return parts


def test_pieces_of_two_ep_ranks_assemble_the_whole_tensor_and_reshard_to_any_ep():
    whole = torch.randn(E, I, H)
    parts = written(whole, 2)
    parts[0][1], parts[1][1] = {"dense": torch.zeros(3)}, {}  # a stage without experts: EP rank 0's alone
    merged = whole_state(parts)
    assert torch.equal(merged[0]["w"], whole) and torch.equal(merged[0]["b"], torch.ones(2))
    assert torch.equal(merged[1]["dense"], torch.zeros(3))
    pieces = written(whole, 4)
    head = pieces[0]
    for p in pieces[1:]:
        head = merge_parts(head, p)
    for ep in (1, 2, 4):
        for r, b in enumerate(ranks_of(ep)):
            assert torch.equal(cut_to_box(head[0]["w"], b), whole[r * E // ep:(r + 1) * E // ep])


def test_a_whole_tensor_is_sliced_and_scalars_pass():
    whole = torch.randn(E, I, H)
    assert torch.equal(cut_experts({"w": whole, "b": torch.zeros(1)}, {"w": box(2, 2)})["w"], whole[2:])
    assert cut_to_box(torch.tensor(3.0), box(2, 2)).item() == 3.0  # Adam's step count
    assert whole_shapes({"w": (2, I, H), "b": (1,)}, {"w": box(2, 2)}) == {"w": (E, I, H), "b": (1,)}


def test_a_checkpoint_of_another_expert_count_or_a_missing_part_is_refused():
    other = expert_pieces({"w": torch.zeros(6, I, H)}, {"w": ExpertBox([0, 0, 0], [6, I, H], [6, I, H])})["w"]
    with pytest.raises(ValueError, match="6 experts .* this model's has 4"):
        cut_to_box(other, box(0, 2))
    only_rank_0 = written(torch.randn(E, I, H), 2)[0][0]["w"]
    with pytest.raises(ValueError, match="expert-parallel part file is missing"):
        cut_to_box(only_rank_0, box(2, 2), "w")
    with pytest.raises(ValueError, match="whole tensor has shape"):
        cut_to_box(torch.zeros(3, I, H), box(0, 2))


class Block(torch.nn.Module):
    def __init__(self, local: int) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(H))
        self.gate_up_proj = torch.nn.Parameter(torch.randn(local, I, H))


def adam_state(module: torch.nn.Module) -> dict:
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    sum(p.sum() for p in module.parameters()).backward()
    opt.step()
    return opt.state_dict()


def test_the_optimizer_state_of_experts_goes_by_name_as_pieces_and_cuts_back():
    torch.manual_seed(0)
    halves = [Block(2), Block(2)]
    boxes = [expert_boxes(m, {"gate_up_proj": (2 * r, E)}) for r, m in enumerate(halves)]
    assert boxes[1]["gate_up_proj"] == box(2, 2)
    order = [["norm", "gate_up_proj"]]
    split = [split_expert_optimizer(adam_state(m), order, b) for m, b in zip(halves, boxes)]
    dense, experts = split[0]
    assert list(dense["state"]) == [0] and dense["param_groups"][0]["params"] == [0, 1]
    merged = whole_state([{0: {"gate_up_proj": experts["gate_up_proj"]}},
                          {0: part_of({"gate_up_proj": split[1][1]["gate_up_proj"]})}])
    moments = torch.cat([s[1]["gate_up_proj"]["exp_avg"]["mpmd.pieces"][0]["tensor"] for s in split])
    assert torch.equal(merged[0]["gate_up_proj"]["exp_avg"], moments)
    whole_box = {"gate_up_proj": box(0, E)}
    named = cut_named_state({"gate_up_proj": merged[0]["gate_up_proj"], "norm": dense["state"][0]}, whole_box)
    assert torch.equal(named["gate_up_proj"]["exp_avg"], moments)
    assert named["gate_up_proj"]["step"] == experts["gate_up_proj"]["step"]
    shard = {"state": {"norm": 1, "gate_up_proj": 2}, "param_groups": []}
    assert without_experts(shard, whole_box)["state"] == {"norm": 1}


def test_ep_part_files_are_named_and_merged_on_read(tmp_path):
    whole = torch.randn(E, I, H)
    parts = written(whole, 2)
    for r, part in enumerate(parts):
        states = {0: {"module": part[0], "ep_parts": 2} if r == 0 else {"module": part[0]}}
        error, _ = write_shard(str(tmp_path), Where(r, 0, r), states, {"cpu": torch.get_rng_state()}, ep_rank=r)
        assert error is None
    assert (tmp_path / part_file("stage-0000.pt", 0, 1)).name == "stage-0000.ep-0001.pt"
    assert part_file("stage-0000.pt", 2, 0) == "stage-0000.tp-0002.pt"
    error, states, _ = read_shard(str(tmp_path), Where(0, 0, 0), [0], rng=False)
    assert error is None
    assert torch.equal(cut_to_box(states[0]["module"]["w"], box(1, 2)), whole[1:3])
