"""`kvforge serve --data-parallel-size N --data-parallel-backend ray`: the replicas as Ray actors across a Ray
cluster. A placement group holds one bundle per replica (the GPUs or CPUs of the ranks it runs itself), placed
with the strategy the user asks (`--data-parallel-placement`: SPREAD, STRICT_SPREAD: one node each, or PACK);
each actor runs a kvforge server on its node's address and reports its URL, and the router in this process
routes to those URLs as it does to local replicas.

```
 this process: router (--host:--port)         Ray node A                    Ray node B
  placement group [bundle 0, bundle 1]         replica 0 actor               replica 1 actor
                                               `kvforge serve` on http://A:P0   on http://B:P1
```

An actor that dies (its process killed, its node gone) is taken out by the router's health checks like a dead
local replica, and a new actor is started in its bundle on the same port; where the bundle moved to another node
(its node was lost), its URL is no longer the router's and it stays out. At shutdown the actors' servers stop
gracefully, then the actors are killed and the placement group freed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from kvforge.executor.ray_ranks import connect, release, reserve
from kvforge.router.replica_set import ReplicaSet, free_port, replica_args, serve_replica

logger = logging.getLogger(__name__)

PLACEMENTS = ("SPREAD", "STRICT_SPREAD", "PACK")
# Seconds an actor may take to start and report its address (a node starting a worker process, importing torch).
_START_TIMEOUT = 300.0


class ReplicaActor:
    """One replica in a Ray worker process (made a Ray actor class, two calls at a time, by RayReplicas): `serve`
    runs its server until `stop` ends it."""

    def __init__(self) -> None:
        self._server = None
        self._stopping = False

    def address(self, port: int | None) -> tuple[str, int, int]:
        """This node's address, a port free on it (`port` where given: a replica started again) and the pid."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, port or free_port(host), os.getpid()

    def serve(self, args: argparse.Namespace) -> None:
        serve_replica(args, on_server=self._started)

    def _started(self, server) -> None:
        self._server = server
        server.should_exit = self._stopping

    def stop(self) -> None:
        """A graceful shutdown (as on SIGTERM): requests in flight get --shutdown-timeout seconds."""
        self._stopping = True
        if self._server is not None:
            self._server.should_exit = True


def _num_ranks_run(args: argparse.Namespace) -> int:
    """The ranks a replica's actor runs itself: all of them with the mp executor, its first with the ray executor
    (whose other ranks get placements of their own)."""
    if args.distributed_executor_backend == "ray":
        return 1
    return args.tensor_parallel_size * args.pipeline_parallel_size


def replica_bundle(args: argparse.Namespace, cluster_gpus: float) -> dict[str, float]:
    """One replica's resources: a GPU per rank it runs itself where it runs on GPUs (--device cuda, or auto on a
    cluster that has GPUs), and --data-parallel-replica-cpus CPUs (default: one beside GPUs, one per rank on
    CPUs)."""
    num_ranks = _num_ranks_run(args)
    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and cluster_gpus > 0)
    num_cpus = args.data_parallel_replica_cpus or (1 if on_gpu else num_ranks)
    return {"CPU": num_cpus, "GPU": num_ranks} if on_gpu else {"CPU": num_cpus}


class RayReplicas(ReplicaSet):
    """`num_replicas` replica actors on the Ray cluster at --ray-address ($RAY_ADDRESS, else a local one started
    here). Constructing it joins the cluster, reserves the bundles and places the actors (their URLs known);
    entering it starts their servers."""

    def __init__(self, args: argparse.Namespace, num_replicas: int, max_restarts: int = 5) -> None:
        on_sigterm = signal.getsignal(signal.SIGTERM)
        self._connected = connect(args.ray_address, needed_by="--data-parallel-backend ray")
        import ray

        self._group = None
        self._actors: list = [None] * num_replicas
        self._done: list = [None] * num_replicas
        try:
            self.bundle = replica_bundle(args, ray.cluster_resources().get("GPU", 0))
            self._group = reserve([self.bundle] * num_replicas, args.data_parallel_placement,
                                  f"{num_replicas} replicas")
            self._args = replica_args(args, max(1, int(self.bundle["CPU"]) // _num_ranks_run(args)))
            self._actor_class = ray.remote(ReplicaActor)
            addresses = [self._place(index, None) for index in range(num_replicas)]
        except BaseException:
            self._stop_actors()
            raise
        # NOTE: joining Ray turned SIGTERM into sys.exit(15), which cleans up while the actors are placed. From
        # here the router's server handles SIGTERM (a graceful shutdown that stops the replicas, then the signal
        # raised again): the command then ends as by SIGTERM, as it does with local replicas.
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
        self._addresses = addresses
        super().__init__([f"http://{host}:{port}" for host, port in addresses], max_restarts,
                         stop_timeout=args.shutdown_timeout + 5)

    def _place(self, index: int, port: int | None) -> tuple[str, int]:
        """A new actor in bundle `index`: its node's address and port."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)
        actor = self._actor_class.options(num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0),
                                          scheduling_strategy=strategy, max_concurrency=2).remote()
        self._actors[index] = actor
        host, port, pid = ray.get(actor.address.remote(port), timeout=_START_TIMEOUT)
        logger.warning("replica on http://%s:%d: pid %d (a Ray actor)", host, port, pid)
        return host, port

    def _start(self, index: int) -> None:
        import ray

        host, port = self._addresses[index]
        if self._actors[index] is None:  # started again
            try:
                moved_to = self._place(index, port)[0]
            except ray.exceptions.RayError as error:
                logger.error("replica %s could not be placed again: %s", self.urls[index], error)
                return
            if moved_to != host:
                logger.error("replica %s: its bundle moved to node %s (its node was lost): it stays out",
                             self.urls[index], moved_to)
                ray.kill(self._actors[index])
                self.num_restarts[index] = self.max_restarts
                return
        one = argparse.Namespace(**vars(self._args))
        one.host, one.port = host, port
        self._done[index] = self._actors[index].serve.remote(one)

    def _exit_reason(self, index: int) -> str | None:
        import ray

        done = self._done[index]
        if done is None:
            reason = "it did not start"
        elif not ray.wait([done], timeout=0)[0]:
            return None
        else:
            try:
                ray.get(done)
                reason = "its server ended"
            except ray.exceptions.RayError as error:
                reason = str(error).strip().splitlines()[0]
        if self._actors[index] is not None:
            ray.kill(self._actors[index])
        self._actors[index], self._done[index] = None, None
        return reason

    def _stop_all(self) -> None:
        import ray

        live = [(actor, done) for actor, done in zip(self._actors, self._done) if actor is not None]
        for actor, _ in live:
            actor.stop.remote()
        running = [done for _, done in live if done is not None]
        if running:
            ray.wait(running, num_returns=len(running), timeout=self.stop_timeout)
        self._stop_actors()

    def _stop_actors(self) -> None:
        """Kill the actors still there (and wait until Ray has seen them die), free the placement group and leave
        the cluster (a local one ends)."""
        import ray

        for actor in self._actors:
            if actor is not None:
                ray.kill(actor)
        running = [done for done in self._done if done is not None]
        if running:
            ray.wait(running, num_returns=len(running), timeout=self.stop_timeout)
        release(self._group, self._connected)
