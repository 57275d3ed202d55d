"""A hand-written schedule: write each rank's order as text, inspect it, train with it.

    python examples/custom_schedule.py
"""

import torch
from torch import nn

import mpmd
import schedules

# Two ranks, three microbatches: rank 0 runs its forwards eagerly (GPipe-like), rank 1
# alternates forward and backward (1F1B-like).  Validation checks that every
# (stage, microbatch) has one forward and one backward on its owner and that the order
# can finish; lowering adds send/recv pairs that cannot deadlock.
text = """
0F0 0F1 0F2 0B0 0B1 0B2
1F0 1B0 1F1 1B1 1F2 1B2
"""
schedule = schedules.Schedule.from_text(text, name="mine")
print(schedule.render())
result = schedules.simulate(schedule, schedules.Costs(f=1.0, b=1.0, w=1.0))
print(f"bubble fraction {result.bubble_fraction:.3f}, peak activations {result.peak_activations}")
print("lowered program:\n" + schedules.lower(schedule).to_text())

torch.manual_seed(0)
stages = [nn.Sequential(nn.Linear(4, 16), nn.Tanh()), nn.Linear(16, 1)]
x, y = torch.randn(12, 4), torch.randn(12, 1)
with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=3, loss_fn=nn.functional.mse_loss,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu") as pipe:
    for step in range(5):
        print(f"step {step}: loss {pipe.step(x, y):.4f}")
