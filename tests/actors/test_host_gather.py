"""Note [gloo all-gathers of CUDA tensors] (actors/host_gather.py): DTensor's all-gathers go
through host memory where gloo would crash on CUDA tensors.  The crash needs a GPU; the kernel
that avoids it is checked here by installing it for CPU tensors in two gloo processes."""
import multiprocessing as mp
import socket

import torch


def _member(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from actors import host_gather

    host_gather.gather_through_host("CPU")
    host_gather.gather_through_host("CPU")  # once per process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
        full = torch.arange(24.0).reshape(4, 6)
        rows = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).redistribute(mesh, [Replicate()])
        cols = distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None).redistribute(mesh, [Replicate()])
        torch.manual_seed(0)
        linear, x = torch.nn.Linear(6, 4), torch.randn(3, 6)
        expected = linear(x)
        expected.square().sum().backward()
        want_grad = linear.weight.grad.clone()
        linear.weight.grad = None
        parallelize_module(linear, mesh, ColwiseParallel(output_layouts=Replicate()), src_data_rank=None)
        out = linear(x)
        out.square().sum().backward()
        grad = linear.weight.grad.full_tensor()
        results.put((rank, torch.equal(rows.to_local(), full), torch.equal(cols.to_local(), full),
                     torch.allclose(out, expected, atol=1e-6), torch.allclose(grad, want_grad, atol=1e-6), host_gather.host_gathers()))
        dist.barrier(group)  # both members past their last collective before either tears its groups down
    finally:
        dist.destroy_process_group()


def test_dtensor_all_gathers_through_host_memory_equal_the_whole_tensor():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    members = [ctx.Process(target=_member, args=(rank, port, results)) for rank in range(2)]
    for m in members:
        m.start()
    for m in members:
        m.join(120)
    assert [m.exitcode for m in members] == [0, 0]
    for rank, rows, cols, out, grad, calls in sorted(results.get(timeout=5) for _ in members):
        assert rows and cols, f"rank {rank}: a redistributed DTensor is not the whole tensor"
        assert out and grad, f"rank {rank}: a column-parallel linear gathered through host memory differs"
        assert calls >= 3, f"rank {rank}: the host kernel ran {calls} times; DTensor's all-gathers did not reach it"
