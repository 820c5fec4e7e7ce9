"""`backend=engine` with `cluster.replicas` > 1: a workload through N engine replicas behind the router.

Each replica is a process with its own `LLMEngine` (on GPU replica i on its own device(s), as
`engine.serve --data-parallel-size` places them: engine/online/replica_launcher.py:replica_args),
whose scheduler is the one the simulator gets (`factory.build_scheduler` from the run's config,
with the replica's measured KV block counts and its own trace recorder). This process feeds the
workload's requests on the wall clock: at each request's arrival time it routes the request with
the run's router (the `router` group, seeded by the run's seed) through a `RemoteFleet`
(policies/routing/replica_report.py: the snapshots built from the replicas' reports, as in the
server's replica set, with `cluster.refresh_s`) and sends it to the chosen replica, which steps its
engine and reports its scheduler's state after every step. All replicas count time from one
`perf_counter` value, so their traces share the run's clock. The traces come back at the end and
are written with a `replica` column, as the simulated fleet's.

The replica processes (models, KV caches, CUDA graphs) are kept for later runs with the same engine
settings (A/B, fidelity), as `engine_backend` keeps its one engine.
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from omegaconf import DictConfig

from experiments.lib import engine_backend
from experiments.lib.backend_run import BackendRun
from experiments.lib.fleet_backend import ClusterConfig, build_router
from experiments.lib.fleet_feed import FleetFeed, start_together
from experiments.lib.workloads import Workload

START_TIMEOUT_S = 900.0  # a replica builds its engine (weights, KV cache, graphs) within this
END_TIMEOUT_S = 120.0  # a replica sends its traces within this once its last request ended
READY_TIMEOUT_S = 120.0  # a replica takes a run's config and workload and resets its engine within this
_FLEET: dict[str, EngineFleet] = {}  # at most one: engine key -> the kept replica processes


class EngineFleet:
    """N replica processes, started and kept between runs."""

    def __init__(self, args, n: int) -> None:
        from engine.online.replica_launcher import replica_args
        ctx = multiprocessing.get_context("spawn")
        self.args = [replica_args(args, i, n) for i in range(n)]
        self.conns: list[Connection] = []
        self.processes = []
        for i, a in enumerate(self.args):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_replica_main, args=(a, child), name=f"servelab-fleet-replica-{i}", daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(p)
        self.info = [self._recv(i, START_TIMEOUT_S) for i in range(n)]

    def _recv(self, i: int, timeout_s: float):
        conn, process = self.conns[i], self.processes[i]
        ready = wait([conn, process.sentinel], timeout_s)
        if conn in ready:
            message = conn.recv()
            if isinstance(message, BaseException):
                raise message
            return message
        if not ready:
            raise TimeoutError(f"engine replica {i} did not answer within {timeout_s} s")
        raise RuntimeError(f"engine replica {i} exited (exit code {process.exitcode})")

    def close(self) -> None:
        for conn, p in zip(self.conns, self.processes):
            try:
                conn.send(None)
            except OSError:
                pass
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def release_fleet() -> None:
    """Stop the kept replica processes (their devices are free again)."""
    for fleet in _FLEET.values():
        fleet.close()
    _FLEET.clear()


engine_backend.OTHER_DEVICE_HOLDERS.append(release_fleet)  # a single engine's run frees the devices first


def run_engine_fleet(cfg: DictConfig, workload: Workload, on_done: Callable[[int], None],
                     cluster: ClusterConfig) -> BackendRun:
    """`cluster`: the run's checked `ClusterConfig` (fleet_backend.py `cluster_config`)."""
    from policies.routing import RemoteFleet
    if cluster.disaggregated:
        raise ValueError(f"cluster.roles={[r.value for r in cluster.roles]!r} is invalid with backend=engine: "
                         "prefill/decode replicas run in the simulator (backend=sim) only (docs/disaggregation.md)")
    if cluster.hardware is not None:
        raise ValueError("cluster.hardware is invalid with backend=engine: the replicas run on this machine's "
                         "GPUs (set it to null)")
    router = build_router(cfg)
    args = engine_backend.engine_args(cfg)
    key = f"{cluster.replicas}:{engine_backend.engine_key(args)}"
    if key not in _FLEET:
        release_fleet()
        engine_backend.release_engine()  # one model per device at a time
        _FLEET[key] = EngineFleet(args, cluster.replicas)
    fleet = _FLEET[key]
    pools = [(a.block_size, info["num_gpu_blocks"]) for a, info in zip(fleet.args, fleet.info)]
    routing = RemoteFleet(router, pools, cluster.refresh_s)
    requests = sorted(workload.requests, key=lambda r: r.arrival_time)
    for conn in fleet.conns:
        conn.send(("run", cfg, workload, router.reads_prefix_index))
    done = 0
    results: dict[int, tuple] = {}  # replica -> (steps, elapsed, recorder), its run's end

    def dispatch(r, now: float) -> None:
        fleet.conns[routing.route(r, now)].send(("add", r, workload.stop_lens.get(r.request_id)))

    def receive(i: int, message) -> None:
        nonlocal done
        if isinstance(message, BaseException):
            raise message
        if message[0] == "done":
            results[i] = message[1:]
            return
        _, ended, report = message
        routing.update(i, report)
        if ended:
            routing.ended(i, ended)
            done += ended
            on_done(ended)

    sentinels = [p.sentinel for p in fleet.processes]
    try:  # a replica that fails or is late to start, or fails in the run, ends the kept fleet
        start = start_together(fleet.conns, sentinels, READY_TIMEOUT_S)
        FleetFeed(fleet.conns, sentinels, requests, start, dispatch, receive, END_TIMEOUT_S).run(
            lambda: done >= len(requests))
    except BaseException as exc:
        exits = [f"replica {i}: exit code {p.exitcode}" for i, p in enumerate(fleet.processes) if not p.is_alive()]
        release_fleet()
        if exits and isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc} ({'; '.join(exits)})") from exc
        raise
    results = [results[i] if i in results else fleet._recv(i, END_TIMEOUT_S)[1:] for i in range(len(fleet.conns))]
    recorders = [recorder for _, _, recorder in results]
    info = [{**fleet.info[i], "replica": i, "device": a.device, "num_routed": routed, "num_steps": steps}
            for i, (a, routed, (steps, _, _)) in enumerate(zip(fleet.args, routing.num_routed, results))]
    run_info = {**fleet.info[0], "replicas": cluster.replicas, "router": router.name,
                "refresh_s": cluster.refresh_s, "replica_info": info}
    return BackendRun(sum(s for s, _, _ in results), max(e for _, e, _ in results), "wall", run_info, recorders)


def _replica_main(args, conn: Connection) -> None:
    """A replica process: build the engine, then serve runs (`_serve_run`) until told to stop (None)
    or the pipe closes."""
    from engine.online.engine_core import pin_device
    engine = None
    try:
        pin_device(args.device)
        engine = engine_backend.LLMEngine(args)
        conn.send(engine_backend.engine_info(engine.runner))
        while (run := conn.recv()) is not None:
            _serve_run(engine, conn, *run[1:])
    except (EOFError, BrokenPipeError):
        return
    except BaseException as exc:
        conn.send(RuntimeError(f"engine replica failed: {type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    finally:
        if engine is not None:
            engine.close()


def _serve_run(engine, conn: Connection, cfg: DictConfig, workload: Workload, report_index: bool) -> None:
    """One run: ("ready",) once the engine is reset, then ("start", the run's t=0 as a perf_counter
    value), ("add", request, output_len) per routed request and ("end",) when no more will come;
    after each step ("step", requests ended, ReplicaReport); at the end ("done", steps, elapsed,
    TraceRecorder)."""
    from experiments.lib import factory
    from policies.routing import report
    from policies.trace import TraceRecorder
    recorder = TraceRecorder()
    engine.reset(build_scheduler=lambda gpu, cpu, _: factory.build_scheduler(cfg, gpu, cpu, recorder, workload))
    conn.send(("ready",))
    message = conn.recv()
    if message[0] != "start":
        raise RuntimeError(f"engine replica: expected the run's start, got {message[0]!r}")
    engine.align_clock(message[1])
    sent, more, num_steps = set() if report_index else None, True, 0
    while more or engine.has_unfinished_requests():
        if conn.poll(0 if engine.has_unfinished_requests() else None):
            while True:
                message = conn.recv()
                if message[0] == "end":
                    more = False
                else:
                    engine_backend.add_workload_request(engine, message[1], message[2])
                if not conn.poll():
                    break
        if engine.has_unfinished_requests():
            ended = sum(o.finished for o in engine.step())
            num_steps += 1
            conn.send(("step", ended, report(engine.scheduler, sent)))
    conn.send(("done", num_steps, engine.now(), recorder))
