"""Ray placement and worker plumbing for the runtime: one bundle per GPU, workers colocated in it.

Pure parts (no ray, no torch; CPU-tested): ``plan_placement`` (which bundle each trainer rank and
each vLLM engine uses), ``worker_env`` (the environment every worker gets). ``local_worker_info`` (who a
worker is: role, rank, node, GPU) and ``gpu_memory_snapshot`` (torch: the memory a calibration record,
``rlc.contract.calibration_record``, holds) run inside the workers.

Ray parts (``ray`` imported inside the functions): ``connect``, ``reserve_gpus``, ``spawn`` and
``WorkerGroup`` (run a method of the worker protocol, ``rlc.runtime.worker_api``, on many workers; a worker
that dies or raises ends the run with a ``WorkerFailure`` naming the worker, its node and its GPU).
"""
from __future__ import annotations

import os
import socket
import time
from importlib import metadata
from dataclasses import dataclass
from typing import Any, Callable, Concatenate, Generic, ParamSpec, Sequence, TypeVar

from rlc.contract.runtime_config import RayConfig, RuntimeConfig
from rlc.runtime.ray_auth import join_address, refused_message, token_refused
from rlc.runtime.worker_api import Memory, WorkerInfo

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")

#: Fraction of a GPU each colocated actor asks Ray for (policy + generation share one bundle).
COLOCATED_GPU_FRACTION = 0.5
#: CPUs per bundle: one for each of the two actors that live in it.
CPUS_PER_BUNDLE = 2
#: Environment every worker needs regardless of the recipe.
#:  - VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs inside the generation actor (engine start
#:    hangs with a child process inside a Ray actor on the GPU host), so refit RPCs reach the worker
#:    in-process.
#:  - NCCL_NVLS_ENABLE=0 etc. (NVLink multicast off) are inherited from the host and kept.
BASE_WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
#: Host variables forwarded to every worker when set (Ray actors of an ``auto`` cluster do not
#: inherit the driver's environment).
FORWARDED_ENV = (
    "PYTHONPATH",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_DEBUG",
)


class PlacementError(ValueError):
    """The parallel layout does not fit the cluster (names the config keys to change)."""


class WorkerFailure(RuntimeError):
    """A worker died or raised; the message names the worker, its node and its GPU."""


# --------------------------------------------------------------------------- placement (pure)


@dataclass(frozen=True)
class Placement:
    """Which bundle (one per GPU) each worker lives in."""

    world_size: int
    bundles: list[dict[str, float]]
    policy_bundles: list[int]  # trainer rank -> bundle index
    engine_bundles: list[list[int]]  # vLLM engine -> bundle indices of its GPUs (its TP x PP ranks)
    gpu_fraction: float  # Ray GPU share of each actor
    colocated: bool

    @property
    def num_engines(self) -> int:
        return len(self.engine_bundles)

    @property
    def gpus_per_engine(self) -> int:
        return len(self.engine_bundles[0]) if self.engine_bundles else 0


def plan_placement(cfg: RuntimeConfig) -> Placement:
    """One bundle per GPU; trainer rank r in bundle r; engine e on bundles [e*k, (e+1)*k).

    ``k = generation_parallel.tp * generation_parallel.pp`` GPUs per vLLM engine. Colocated only:
    the trainer and the engines share every GPU (``num_gpus=0.5`` each in the same bundle).
    """
    world = cfg.cluster.world_size
    if world != cfg.cluster.nodes * cfg.cluster.gpus_per_node:
        raise PlacementError(
            f"cluster.world_size={world} but cluster.nodes * cluster.gpus_per_node = "
            f"{cfg.cluster.nodes * cfg.cluster.gpus_per_node}; recompile the bundle"
        )
    tp = cfg.train_parallel
    model_parallel = tp.tp * tp.pp * tp.cp
    if world % model_parallel:
        raise PlacementError(
            f"train_parallel tp*pp*cp = {tp.tp}*{tp.pp}*{tp.cp} = {model_parallel} does not divide the "
            f"{world} GPUs; change parallelism.train"
        )
    if tp.dp != world // model_parallel:
        raise PlacementError(f"train_parallel.dp={tp.dp} but world / (tp*pp*cp) = {world // model_parallel}; recompile")
    gp = cfg.generation_parallel
    per_engine = gp.tp * gp.pp
    if world % per_engine:
        raise PlacementError(
            f"generation tp*pp = {gp.tp}*{gp.pp} = {per_engine} does not divide the {world} GPUs; change "
            "parallelism.generation"
        )
    engines = world // per_engine
    if gp.dp != engines:
        raise PlacementError(
            f"generation_parallel.dp={gp.dp} but the {world} GPUs hold {engines} engines of tp*pp={per_engine}; "
            "recompile the bundle"
        )
    if not cfg.colocated:
        raise PlacementError(
            "colocated: false is not supported by this runtime yet (trainer and vLLM must share GPUs); set "
            "colocated: true"
        )
    bundles = [{"GPU": 1.0, "CPU": float(CPUS_PER_BUNDLE)} for _ in range(world)]
    # generation.backend megatron: the engines live in the policy workers, no generation actors
    in_policy = getattr(cfg.generation, "backend", "vllm") == "megatron"
    return Placement(
        world_size=world,
        bundles=bundles,
        policy_bundles=list(range(world)),
        engine_bundles=[] if in_policy else [list(range(e * per_engine, (e + 1) * per_engine)) for e in range(engines)],
        gpu_fraction=COLOCATED_GPU_FRACTION,
        colocated=True,
    )


def order_bundles_by_node(bundle_nodes: Sequence[str]) -> list[int]:
    """Bundle indices sorted so that bundles of one node are contiguous (stable within a node).

    Ray does not promise that bundle ``i`` of a PACK group lands on node ``i // gpus_per_node``;
    ranks are assigned in this order so a trainer's TP group stays inside a node.
    """
    first_seen: dict[str, int] = {}
    for i, node in enumerate(bundle_nodes):
        first_seen.setdefault(node, i)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first_seen[bundle_nodes[i]], i))


def worker_env(cfg: RuntimeConfig, host_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of every worker: ``BASE_WORKER_ENV``, forwarded host variables, then ``cfg.env``.

    Refuses ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: vLLM's sleep-mode allocator asserts
    on it (NeMo-RL #2471, attempt 4).
    """
    host = os.environ if host_env is None else host_env
    env = dict(BASE_WORKER_ENV)
    env.update({k: host[k] for k in FORWARDED_ENV if k in host})
    env.update({str(k): str(v) for k, v in (cfg.env or {}).items()})
    alloc = env.get("PYTORCH_CUDA_ALLOC_CONF", host.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if "expandable_segments:true" in alloc.replace(" ", "").lower():
        raise PlacementError(
            "PYTORCH_CUDA_ALLOC_CONF contains expandable_segments:True, which vLLM's sleep-mode memory pool "
            "rejects (AssertionError in cumem.py); remove it from env / the job environment"
        )
    return env


# --------------------------------------------------------------------------- who a worker is


def local_worker_info(role: str, rank: int, bundle: int = -1) -> WorkerInfo:
    """This process's identity (called inside an actor; uses ray and torch if present)."""
    node_ip, gpu_uuid = "?", "?"
    gpu_ids: list[Any] = [os.environ.get("CUDA_VISIBLE_DEVICES", "?")]
    try:
        import ray  # noqa: PLC0415 - the worker runs inside Ray; the driver's module imports no GPU stack

        node_ip = ray.util.get_node_ip_address()
        gpu_ids = list(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - not inside ray: the environment's GPU
        pass
    try:
        import torch  # noqa: PLC0415 - (the GPU stack, as above)

        if torch.cuda.is_available():
            gpu_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except Exception:  # noqa: BLE001 - no usable CUDA: the uuid stays unknown
        pass
    return WorkerInfo(role=role, rank=rank, node_ip=node_ip, hostname=socket.gethostname(), pid=os.getpid(),
                      gpu_ids=gpu_ids, gpu_uuid=gpu_uuid, bundle=bundle)


# --------------------------------------------------------------------------- memory / calibration


GIB = float(1 << 30)


def gpu_memory_snapshot() -> Memory:
    """GPU memory seen from this process: device free/used/total (all processes) and this process's
    torch allocated/reserved, in GiB."""
    import torch  # noqa: PLC0415 - called in the workers; the driver's module imports no GPU stack

    free, total = torch.cuda.mem_get_info()
    return Memory(free_gib=free / GIB, used_gib=(total - free) / GIB, total_gib=total / GIB,
                  torch_allocated_gib=torch.cuda.memory_allocated() / GIB,
                  torch_reserved_gib=torch.cuda.memory_reserved() / GIB)


def library_versions() -> dict[str, str]:
    """Versions of the stack, for calibration records (missing packages are skipped)."""
    out = {}
    for dist in ("torch", "vllm", "ray", "megatron-core", "megatron-bridge", "transformer-engine", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


# --------------------------------------------------------------------------- ray plumbing


def connect(ray_cfg: RayConfig, env: dict[str, str]) -> str:
    """Connect to Ray: ``local`` starts a private cluster; ``auto``/``host:port`` joins one.

    Retries joining for ``ray.join_timeout_s`` (the head may still be starting inside sbatch), but
    not a head that refuses this process's token (:mod:`rlc.runtime.ray_auth`): that fails at once.
    Returns a description of the cluster for the log.
    """
    import ray  # noqa: PLC0415

    runtime_env = {"env_vars": dict(env)}
    # "auto" inside the sbatch job joins the job's head (launch.sbatch exports RAY_ADDRESS); run by
    # hand (no RAY_ADDRESS) the same bundle starts a private local cluster instead of waiting.
    by_hand = ray_cfg.address == "auto" and not os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():  # embedded (tests, notebooks): use the caller's cluster
        pass
    elif ray_cfg.address == "local" or by_hand:
        if by_hand:
            print("[rlc] RAY_ADDRESS is not set (not inside an rlc sbatch job): starting a local Ray cluster",
                  flush=True)
        # address="local": always a new cluster. With no address Ray joins the cluster named in
        # /tmp/ray/ray_current_cluster, which a killed earlier run leaves behind, and retries it forever.
        ray.init(address="local", namespace=ray_cfg.namespace, runtime_env=runtime_env, include_dashboard=False,
                 log_to_driver=True)
    else:
        from ray.exceptions import AuthenticationError  # noqa: PLC0415 - (Ray, as above)

        deadline = time.monotonic() + max(1, ray_cfg.join_timeout_s)
        address = join_address(ray_cfg.address)
        while True:
            # A head that refuses the token is not "still starting": fail now, naming the token's source.
            refused = token_refused(address)
            if refused:
                raise WorkerFailure(refused_message(address or ray_cfg.address, refused))
            try:
                ray.init(address=ray_cfg.address, namespace=ray_cfg.namespace, runtime_env=runtime_env,
                         log_to_driver=True)
                break
            except AuthenticationError as exc:  # no token at all on this side
                raise WorkerFailure(refused_message(address or ray_cfg.address, exc.message)) from None
            except (ConnectionError, RuntimeError) as exc:
                if time.monotonic() > deadline:
                    raise WorkerFailure(
                        f"could not join the Ray cluster at {ray_cfg.address!r} within {ray_cfg.join_timeout_s} s "
                        f"({exc}); is the head running (launch.sbatch starts it) and cluster.ray.address right?"
                    ) from exc
                time.sleep(2)
    res = ray.cluster_resources()
    return (
        f"ray {ray.__version__}: {int(res.get('GPU', 0))} GPUs, {int(res.get('CPU', 0))} CPUs, {len(ray.nodes())} nodes"
    )


def reserve_gpus(placement: Placement, timeout_s: float = 300.0):
    """Create the placement group (one bundle per GPU) and wait for it; returns ``(pg, bundle_order)``.

    ``bundle_order[i]`` is the bundle that plays logical bundle ``i`` (bundles of a node contiguous).
    """
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group, placement_group_table  # noqa: PLC0415

    have = ray.cluster_resources().get("GPU", 0)
    if have < placement.world_size:
        raise PlacementError(
            f"the Ray cluster has {have:g} GPUs, the bundle needs {placement.world_size} "
            "(cluster.nodes x cluster.gpus_per_node); are all nodes joined?"
        )
    pg = placement_group(placement.bundles, strategy="PACK", name="rlc-gpus")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise PlacementError(
            f"could not reserve {placement.world_size} bundles {placement.bundles[0]} within {timeout_s:g} s; "
            f"cluster resources: {ray.available_resources()}"
        )
    table = placement_group_table(pg)
    nodes_by_bundle = table.get("bundles_to_node_id", {})
    nodes = [str(nodes_by_bundle.get(i, "")) for i in range(placement.world_size)]
    return pg, order_bundles_by_node(nodes)


def spawn(cls: type, *, pg: Any, bundle: int, num_gpus: float, env: dict[str, str], name: str,
          num_cpus: float = 1.0, args: tuple = (), kwargs: dict | None = None):
    """Start ``cls`` as a Ray actor in bundle ``bundle`` of ``pg``."""
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

    actor_cls: Any = ray.remote(cls)
    return actor_cls.options(
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        name=name,
        max_concurrency=1,
        runtime_env={"env_vars": dict(env)},
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=True
        ),
    ).remote(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Pending(Generic[R]):
    """A worker method running: the worker (group and rank) and Ray's reference to its answer."""

    group: WorkerGroup[Any]
    rank: int
    ref: Any  # ray.ObjectRef of an R


def remote_method(actor: Any, method: Callable[..., Any]) -> Any:
    """The Ray actor's handle of ``method`` (a method of the worker's class or protocol): the one place a
    method reference becomes the name Ray dispatches on."""
    return getattr(actor, method.__name__)


class WorkerGroup(Generic[W]):
    """Actors of one role (workers implementing ``W``) with their identities.

    ``call(Api.method, *args)`` runs a method of the worker protocol on every worker and returns the answers in
    rank order; ``call_on`` runs it on one worker; ``submit``/``submit_to`` start it and return :class:`Pending`
    answers for :func:`wait_all`. The method is a reference (``PolicyWorkerApi.setup``), so the type checker
    checks the arguments and the answer. A worker that dies or raises ends the call with a ``WorkerFailure``
    naming the worker, its node and its GPU.
    """

    def __init__(self, role: str, actors: list[Any], infos: list[WorkerInfo] | None = None) -> None:
        self.role = role
        self.actors = actors
        self.infos = infos or [WorkerInfo(role=role, rank=i) for i in range(len(actors))]

    def __len__(self) -> int:
        return len(self.actors)

    def submit_to(self, rank: int, method: Callable[Concatenate[W, P], R], *args: P.args,
                  **kwargs: P.kwargs) -> Pending[R]:
        """Start ``method`` on worker ``rank``."""
        return Pending(self, rank, remote_method(self.actors[rank], method).remote(*args, **kwargs))

    def submit(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[Pending[R]]:
        """Start ``method`` on every worker."""
        return [self.submit_to(rank, method, *args, **kwargs) for rank in range(len(self.actors))]

    def call(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``method`` on every worker; the answers in rank order."""
        return wait_all(self.submit(method, *args, **kwargs), f"{self.role}.{method.__name__}")

    def call_on(self, rank: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``method`` on worker ``rank``; its answer."""
        answer: R = wait_all([self.submit_to(rank, method, *args, **kwargs)], f"{self.role}.{method.__name__}")[0]
        return answer


def wait_all(pending: Sequence[Pending[Any]], what: str) -> list[Any]:
    """The answers of ``pending`` (of one group or several) in order; the first failure raises ``WorkerFailure``
    naming that worker."""
    import ray  # noqa: PLC0415 - the driver's module imports no GPU stack (CPU tests, the compiler's checks)
    from ray.exceptions import RayActorError, RayError  # noqa: PLC0415 - (as above)

    results: dict[int, Any] = {}
    index_of = {p.ref: n for n, p in enumerate(pending)}
    remaining = [p.ref for p in pending]
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1)
        ref = done[0]
        n = index_of[ref]
        group, rank = pending[n].group, pending[n].rank
        try:
            results[n] = ray.get(ref)
        except RayError as exc:
            info = group.infos[rank] if rank < len(group.infos) else WorkerInfo(group.role, rank)
            raise worker_failure(info, isinstance(exc, RayActorError), what, str(exc)) from exc
    return [results[n] for n in range(len(pending))]


def stop_groups(groups: Sequence[WorkerGroup[Any] | None], graceful_timeout_s: float = 30.0) -> list[str]:
    """Ask every worker to shut down, wait at most ``graceful_timeout_s``, then kill them all.

    A worker still blocked in a call (say, a vLLM engine waiting in ``refit_prepare`` for a trainer rank
    that already failed) would queue the shutdown behind that call forever; killing it ends the job
    instead of leaving it hanging (the vLLM engine's own Ray workers die with it). Returns the workers
    that did not finish their shutdown in time.
    """
    import ray  # noqa: PLC0415

    late: list[str] = []
    for group in groups:
        if group is None:
            continue
        refs = {a.shutdown.remote(): i for i, a in enumerate(group.actors)}
        try:
            _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=graceful_timeout_s)
        except Exception:  # noqa: BLE001 - a dead actor must not stop the others from being killed
            pending = list(refs)
        late += [f"{group.role} {refs[r]}" for r in pending]
        for actor in group.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
    return late


def worker_failure(info: WorkerInfo, died: bool, what: str, detail: str) -> WorkerFailure:
    """The report for a worker that died (its actor is gone) or failed (raised) during ``what``:
    who, where, and the last 25 lines of Ray's error."""
    tail = "\n".join(detail.strip().splitlines()[-25:])
    return WorkerFailure(f"{info.describe()} {'died' if died else 'failed'} during {what}:\n{tail}")
