"""Placement on a multi-node cluster, and attaching to a Ray started with ``ray start``.

Neither can share the session Ray, so each runs in a subprocess: this file run as a
script (``python tests/mpmd/runtime/test_cluster.py multinode|attach ADDRESS``) prints one JSON
line the test checks.  Every Ray these tests start lives under its own ``RAY_TMPDIR``,
so no other Ray on the machine sees it (``ray.init()`` elsewhere would otherwise
attach to the newest local cluster) and it is stopped by signalling only the
processes started here, never with ``ray stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
PYTHON = sys.executable
RAY = str(pathlib.Path(sys.executable).with_name("ray"))
STEPS, BATCH = 3, 8


# -- the subprocess side ---------------------------------------------------------------------------
def _train(address: str, placement: str, dp: int):
    """Train 2 stages x ``dp`` replicas against the reference; returns the node of each actor,
    the largest relative errors, and the names of the cluster's named actors while it ran."""
    import ray
    from torch.nn import functional as F

    import mpmd
    from tests.models import make_data, make_stages, reference_train, sgd

    stages, data = make_stages(2), make_data(STEPS, BATCH)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd, dp=dp,
                       device="cpu", address=address, placement=placement) as pipe:
        nodes = ray.get([a.node_id.remote() for a in pipe.actors])
        names = sorted(n["name"] for n in ray.util.list_named_actors(all_namespaces=True))
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    model, ref_losses = reference_train(stages, data, num_microbatches=2 * dp, loss_fn=F.mse_loss, optimizer=sgd)
    param_err = max(((state[k] - v).abs() / (v.abs() + 1e-6)).max().item() for k, v in model.state_dict().items())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    return {"nodes": nodes, "param_rel_err": param_err, "loss_rel_err": loss_err, "names": names}


def _main_multinode() -> dict:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        # spread: the two ranks on two nodes (activations cross nodes); pack: each replica's
        # ranks on one node (the DP all-reduce crosses nodes).  Each pipeline opens and
        # closes its own connection.
        out = {"spread": _train(cluster.address, "spread", dp=1), "pack": _train(cluster.address, "pack", dp=2)}
        ray.init(address=cluster.address)
        out["num_nodes"] = sum(n["Alive"] for n in ray.nodes())
        ray.shutdown()
        return out
    finally:
        cluster.shutdown()


def _main_attach(address: str) -> dict:
    import ray

    out = _train(address, "pack", dp=1)
    # The pipeline opened the connection and closed it on shutdown; look again from a new one.
    ray.init(address=address)
    try:
        out["alive_nodes"] = sum(n["Alive"] for n in ray.nodes())
        out["cpus"] = ray.cluster_resources().get("CPU", 0)
        # Release is asynchronous: a placement group asking for every CPU becomes ready
        # exactly when the pipeline's bundles are back.
        whole = ray.util.placement_group([{"CPU": out["cpus"]}])
        freed = bool(ray.wait([whole.ready()], timeout=30)[0])
        ray.util.remove_placement_group(whole)
        out["names_after"] = sorted(n["name"] for n in ray.util.list_named_actors(all_namespaces=True))
        out["free_cpus_after"] = out["cpus"] if freed else 0
    finally:
        ray.shutdown()
    return out


# -- process handling --------------------------------------------------------------------------------
def _env(tmp: str, **extra: str) -> dict:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "RAY_TMPDIR": tmp, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "", **extra}


def _children(pid: int) -> list[int]:
    kids = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for kid in _children(todo.pop()):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> bool:
    """Read ``proc``'s output until a line contains ``text``; keep draining it afterwards
    (a full pipe would block the process)."""
    found = threading.Event()

    def read():
        for line in proc.stdout:
            if text in line:
                found.set()
        proc.stdout.close()

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout)


def _stop(proc: subprocess.Popen, known: set[int]) -> list[int]:
    """SIGTERM ``proc`` (its Ray cleans up after itself), then SIGKILL whatever it and its
    descendants left.  Only these processes are signalled.  Returns the survivors."""
    known = known | _descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for pid in known:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _wait_exit([p for p in known if _alive(p)], timeout=10)
    return sorted(p for p in known if _alive(p))


def _wait_exit(pids: list[int], timeout: float) -> None:
    """Block until the processes exit (pidfds become readable), at most ``timeout`` seconds."""
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        waiting = len(fds)
        while waiting and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                poller.unregister(fd)  # an exited process's pidfd stays readable
                waiting -= 1
    finally:
        for fd in fds:
            os.close(fd)


def _run_script(args: list[str], env: dict, timeout: float) -> dict:
    log = pathlib.Path(env["RAY_TMPDIR"], f"{args[0]}.log")
    with log.open("w") as sink:  # a file, not a pipe: a chatty Ray cannot block the script
        proc = subprocess.Popen([PYTHON, __file__, *args], env=env, cwd=str(REPO), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    known: set[int] = set()
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            known |= _descendants(proc.pid)  # Ray's processes, to clean up if they outlive the script
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
    finally:
        survivors = _stop(proc, known)
    out = log.read_text()
    assert not survivors, f"processes left behind: {survivors}"
    assert proc.returncode == 0, f"{' '.join(args)} failed (rc {proc.returncode}):\n{out[-4000:]}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result:\n{out[-4000:]}"
    return json.loads(lines[-1])


def _grid(names: list[str], dp: int) -> bool:
    """Whether one pipeline's actors are among ``names``: ``mpmd-<id>-d<replica>-r<rank>``, 2 ranks."""
    pipelines: dict[str, set] = {}
    for name in names:
        prefix, tag, replica, rank = (name.split("-") + ["", "", "", ""])[:4]
        if prefix == "mpmd":
            pipelines.setdefault(tag, set()).add((replica, rank))
    return {(f"d{d}", f"r{r}") for d in range(dp) for r in range(2)} in pipelines.values()


@pytest.fixture
def ray_tmp():
    # Short: Ray's unix socket paths live under it.
    tmp = tempfile.mkdtemp(prefix="mpmd-", dir="/tmp")
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the tests ---------------------------------------------------------------------------------------
def test_multinode_spread_places_on_several_nodes_and_trains_correctly(ray_tmp):
    out = _run_script(["multinode"], _env(ray_tmp), timeout=300)
    assert out["num_nodes"] == 2
    for placement, actors in (("spread", 2), ("pack", 4)):
        res = out[placement]
        assert len(res["nodes"]) == actors
        assert res["param_rel_err"] < 1e-5 and res["loss_rel_err"] < 1e-5, (placement, res)
        assert _grid(res["names"], dp=actors // 2)
    assert len(set(out["spread"]["nodes"])) == 2
    # pack: 4 one-CPU actors on two 2-CPU nodes; each replica's two ranks share a node.
    replica0, replica1 = out["pack"]["nodes"][:2], out["pack"]["nodes"][2:]
    assert len(set(replica0)) == 1 and len(set(replica1)) == 1 and replica0 != replica1


def test_attach_to_a_running_head_leaves_it_up_and_clean(ray_tmp):
    # `ray start` turns on token authentication; Ray's client uses it by itself only for
    # address="auto", so a "host:port" attach says RAY_AUTH_MODE=token (as a user would).
    env = _env(ray_tmp, RAY_AUTH_MODE="token")
    port = _free_port()
    # A fixed default agent port (52365) would collide with another head here.  (No client-server
    # port: the Ray client server needs ray[client], which the project does not install.)
    head = subprocess.Popen(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false", "--block",
         f"--temp-dir={ray_tmp}/ray", "--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    known: set[int] = set()
    try:
        started = _wait_for_line(head, "Ray runtime started", timeout=120)
        assert started, f"ray start --head did not come up (rc {head.poll()})"
        known |= _descendants(head.pid)
        out = _run_script(["attach", f"127.0.0.1:{port}"], env, timeout=240)
        assert head.poll() is None, "the head stopped with the pipeline"
        assert out["param_rel_err"] < 1e-5 and out["loss_rel_err"] < 1e-5
        assert _grid(out["names"], dp=1)
        assert out["alive_nodes"] == 1 and out["cpus"] == 4
        assert out["names_after"] == [], "pipeline actors outlived shutdown"
        assert out["free_cpus_after"] == 4, "the pipeline's placement group still holds CPUs"
    finally:
        survivors = _stop(head, known)
    assert not survivors, f"processes of the head left behind: {survivors}"


@pytest.mark.parametrize("cause, match", [
    ("Failed to connect to GCS: AuthenticationError: InvalidAuthToken",
     r"requires token authentication.*Set RAY_AUTH_MODE=token"),
    ("Failed to connect to GCS: timed out", r"check that it is running: `ray status --address=10.0.0.5:6379`"),
], ids=["token-auth", "unreachable"])
def test_attach_failure_says_how_to_fix(monkeypatch, cause, match):
    import ray

    from mpmd.runtime import cluster

    def refused(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379") from RuntimeError(cause)

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refused)
    with pytest.raises(ConnectionError, match=match):
        cluster.connect("10.0.0.5:6379", actors_needed=2, cpus_per_actor=1.0)


if __name__ == "__main__":
    sys.path[:0] = [str(REPO)]
    mode = sys.argv[1]
    result = _main_multinode() if mode == "multinode" else _main_attach(sys.argv[2])
    print(json.dumps(result), flush=True)
