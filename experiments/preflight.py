"""What is checked and started before a run's algorithm is built, in this order: the data files and a model
directory (``check_data``, ``check_model``), the algorithm config and where the parts land on the GPUs
(``check_before_ray``, ``check_placement``), the memory plan against the GPU (``check_memory``), the local Ray
instance or the cluster joined (``start_ray``), whether the cluster holds the actors' resources and has the devices
the defaults were chosen for (``check_resources``), and last the start policy where it is the env's warm start
(``prepare_start``: built the first time). Every problem is a ``SettingsError`` naming the option, before any weights
load or anything is written."""

from __future__ import annotations

import os
import sys

import envs
from algos.tree_grpo import settings as algorithm_settings
from envs.datasets import DataError, MissingDataError, UnknownSplitError
from experiments.cli import SettingsError
from experiments.qa_start import QA_START_BASE_MODEL, WARM_START_MODEL, QASource, check_has_warm_start, qa_warm_start
from experiments.settings import (
    RunSettings,
    build_config,
    device_following,
    engines_beside_a_learner,
    env_config,
    memory_options,
)


def check_data(settings: RunSettings) -> None:
    """The data directory, the corpus and the question files the run reads (its training split; with evaluations,
    the evaluation splits), or a ``SettingsError`` naming the path and the expected layout (or the split the dataset
    lacks); ``--model warm-start`` only where the env has one; and, for a generated world, that ``--max-turns``
    allows the searches its questions need."""
    evaluated = ({settings.env} if settings.eval_every else set()) | (
        set(settings.eval_envs or [settings.env]) if settings.final_eval else set())
    if settings.model == WARM_START_MODEL:
        try:
            check_has_warm_start(settings.env)  # before its data: another env's files would be named as missing
        except ValueError as error:
            raise SettingsError(str(error)) from None
    try:
        config = env_config(settings)  # resolves the data directory
        envs.question_count(settings.env, **config)
        for env_id in sorted(evaluated):
            envs.question_count(env_id, **{**config, "split": envs.eval_split(env_id)})
        hops = envs.world_hops(settings.env, **config)
        if settings.model == WARM_START_MODEL:
            QASource.of(settings.env, config["data_dir"])  # what its build reads
        for env_id in sorted({settings.env} | evaluated):
            envs.corpus_file(env_id, **config)  # what each env runner's and evaluator's env searches
    except (MissingDataError, DataError) as error:
        raise SettingsError(str(error)) from None
    except UnknownSplitError as error:
        raise SettingsError(f"split: {error} (--split)") from None
    if hops is not None and hops > settings.max_turns:
        raise SettingsError(f"--max-turns {settings.max_turns}: the {settings.env} world the run would serve asks "
                            f"{hops}-hop questions, one search per hop, which {settings.max_turns} search steps "
                            f"cannot answer: raise --max-turns to {hops}, or write a world with fewer hops "
                            f"(python -m envs.synthetic --help) and pass its directory as --data-dir")


def check_before_ray(settings: RunSettings) -> None:
    """What can be checked without Ray, before it starts and before anything is written: the data and the
    algorithm config as RLlib's ``validate`` sees it (e.g. more env runners than prompts). (``start_ray`` checks
    the actors' resources.)"""
    check_data(settings)
    check_model(settings)
    check_learner_device(settings)
    check_placement(settings)
    try:
        build_config(settings).validate()
    except ValueError as error:
        raise SettingsError(str(error)) from None
    print(placement_line(settings), file=sys.stderr)  # a run that is refused says only why
    if settings.memory_check:
        check_memory(settings)


def prepare_start(settings: RunSettings) -> None:
    """Build the run's start policy where it is the env's warm start and not yet cached (once; minutes, said before
    it starts), so that every actor finds it."""
    if settings.model == WARM_START_MODEL:
        qa_warm_start(settings.env, settings.data_dir)


def cluster_address(settings: RunSettings) -> str | None:
    """The Ray cluster the run joins (``--ray-address``, else ``$RAY_ADDRESS``), or None for a local instance."""
    return settings.ray_address or os.environ.get("RAY_ADDRESS")


def check_model(settings: RunSettings) -> None:
    """A ``--model`` spelt as a local path that names no model directory (a typo, a file, a folder without weights):
    refused here, not as a traceback from the actors once Ray has started. A hub id is found on its first download."""
    from policies.models import ALIASES, ModelNotFoundError, check_model_name

    if settings.model in (*ALIASES, WARM_START_MODEL):
        return
    try:
        check_model_name(settings.model)
    except ModelNotFoundError as error:
        raise SettingsError(f"--model: {error}") from None


def check_learner_device(settings: RunSettings) -> None:
    """Refuse learners asked to train on a GPU where none can be had: the local learner (``--num-learners 0``) when
    this process sees no GPU; remote ones when no GPU is visible and no cluster is joined (a cluster's nodes bring
    their own GPUs, which ``check_resources`` counts once Ray is up)."""
    gpus = settings.num_gpus_per_learner
    if not gpus or algorithm_settings.gpu_visible() or (settings.num_learners and cluster_address(settings)):
        return
    where = ("the local learner (--num-learners 0) runs in this process" if not settings.num_learners
             else f"the {settings.num_learners} remote learner(s) would start on this machine's Ray")
    raise SettingsError(f"--num-gpus-per-learner {gpus:g}: no GPU is visible here and {where}: pass "
                        f"--num-gpus-per-learner 0 to train on the CPU, or run where a GPU is visible")


def check_placement(settings: RunSettings) -> None:
    """Refuse two parts that would land on one GPU where the memory plan does not count them together (the plan
    counts one rollout engine beside a learner: ``experiments.settings.engines_beside_a_learner``): learners sharing
    a GPU; the learner in this process, on GPU 0 outside Ray's accounting, beside env runners asking Ray for whole
    GPUs (Ray may give them GPU 0); more engines than one beside a learner."""
    learners, learner_gpu = settings.num_learners, settings.num_gpus_per_learner
    runners, runner_gpu = settings.num_env_runners, settings.num_gpus_per_env_runner
    if learners > 1 and 0 < learner_gpu < 1:
        raise SettingsError(
            f"--num-gpus-per-learner {learner_gpu:g} with --num-learners {learners}: Ray would put two learners on "
            f"one GPU, where NCCL cannot hold two ranks of their process group (and the memory plan counts one "
            f"learner per GPU): give each learner a whole GPU, --num-gpus-per-learner 1")
    if not learners and learner_gpu and runners and runner_gpu >= 1:
        raise SettingsError(
            f"the learner in this process (--num-learners 0) trains on GPU 0, which Ray does not count as taken, so "
            f"it may give GPU 0 to one of the {runners} env runner(s) asking --num-gpus-per-env-runner "
            f"{runner_gpu:g}, and the memory plan counts them apart: place the learner through Ray too "
            f"(--num-learners 1), or sample in this process (--num-env-runners 0: the engine beside the learner, "
            f"planned), or give one env runner a share of a GPU (--num-gpus-per-env-runner 0.5: planned beside the "
            f"learner)")
    engines = engines_beside_a_learner(settings)
    if engines > 1:
        where = ("the learner in this process (--num-learners 0), on GPU 0 outside Ray's accounting" if not learners
                 else f"a learner (--num-gpus-per-learner {learner_gpu:g})")
        free = 1.0 - (learner_gpu if learners else 0.0)
        raise SettingsError(
            f"--num-gpus-per-env-runner {runner_gpu:g}: up to {engines} of the {runners} env runner(s)' engines can "
            f"land on the GPU of {where}, but the memory plan counts one engine beside a learner: give each env "
            f"runner more than {free / 2:g} of a GPU, or run one, or place whole-GPU learners through Ray "
            f"(--num-learners 1 --num-gpus-per-learner 1), which keeps the env runners off their GPUs")


def placement_line(settings: RunSettings) -> str:
    """Where the run's parts run, in one line (printed before Ray starts): the learners and the rollouts."""
    device = f"on a GPU ({settings.num_gpus_per_learner:g} each)" if settings.num_gpus_per_learner else "on the CPU"
    learners = ("learner: in this process" if not settings.num_learners
                else f"learners: {settings.num_learners} remote (Ray actors)")
    if settings.num_env_runners:
        runner_device = (f"on a GPU ({settings.num_gpus_per_env_runner:g} each)" if settings.num_gpus_per_env_runner
                         else "on the CPU")
        rollouts = f"rollouts: {settings.num_env_runners} remote env runner(s), {runner_device}"
    else:
        rollouts = "rollouts: in this process, " + ("on the GPU" if algorithm_settings.gpu_visible() else "on the CPU")
    device += learner_threads_note(settings)
    return f"placement: {learners}, {device}; {rollouts} ({settings.generator_backend} engine)"


def learner_threads_note(settings: RunSettings) -> str:
    """The torch threads of the learner in this process where the run sets them (``--learner-threads``, or with
    ``--max-staleness 1`` the cores the remote env runners leave, as ``TreeGRPO`` does), for the placement line."""
    import torch

    if settings.num_learners or (settings.learner_threads is None and not settings.max_staleness):
        return ""
    if settings.learner_threads is not None:
        return f", {settings.learner_threads} torch thread(s) (--learner-threads)"
    why = "which sample while it updates (max_staleness 1; --learner-threads sets it)"
    if cluster_address(settings):  # where Ray places the runners is known once it has
        return f", torch threads: this machine's cores less those of the remote env runners placed on it, {why}"
    cores = algorithm_settings.available_cores()
    runner = algorithm_settings.env_runner_threads(settings.num_cpus_per_env_runner)
    threads = algorithm_settings.split_threads(cores, [runner] * settings.num_env_runners, torch.get_num_threads())
    return (f", {threads} torch thread(s): this machine's {cores} cores less the remote env runners' {runner} each, "
            f"{why}")


def check_memory(settings: RunSettings) -> None:
    """Print the run's memory plan (one line, stderr) and refuse a run planned above its GPU's memory: before any
    weights load (a learner on the CPU, ``--num-gpus-per-learner 0``, is planned without a verdict). A model whose
    shape cannot be found (a hub id not yet downloaded) is planned after its first download; the run goes on."""
    import torch

    from policies.memory import GIB
    from policies.memory_fit import fitting_change
    from policies.memory_plan import plan_memory
    from policies.memory_report import plan_line
    from policies.model_shape import ModelShapeError, model_shape

    try:  # the warm start, not built yet, has its base model's shape
        shape = model_shape(QA_START_BASE_MODEL if settings.model == WARM_START_MODEL else settings.model)
    except ModelShapeError as error:
        print(f"memory plan: not made ({error})", file=sys.stderr)
        return
    on_gpu = torch.cuda.is_available() and settings.num_gpus_per_learner > 0  # a CPU learner: nothing to judge
    gpu = torch.cuda.get_device_properties(0).total_memory / GIB if on_gpu else None
    plan = plan_memory(shape, memory_options(settings, gpu))
    # on a CPU learner the GPU figures only size a GPU run: this run's memory is the host's, which they do not plan
    where = "" if on_gpu else "; the learner is on the CPU, so nothing here is judged against this machine"
    print(plan_line(plan) + where, file=sys.stderr)
    if plan.fits is False:
        biggest = max(plan.parts, key=plan.parts.get)
        change = fitting_change(plan)
        raise SettingsError(
            f"the memory plan needs {plan.per_gpu_gib:.1f} GiB per GPU in the {plan.phase}, over the "
            f"{plan.usable_gib:.1f} GiB usable of the GPU's {gpu:.1f} GiB ({biggest.replace('_', ' ')} the largest "
            f"part, {plan.parts[biggest]:.1f} GiB): "
            + (f"it would fit with {change}" if change else "none of the memory options tried makes it fit")
            + "; python experiments/plan_memory.py compares the options, --no-memory-check goes on anyway")


def local_resources() -> dict[str, float]:
    """The resources of the local Ray instance ``start_ray`` starts: every CPU of the machine and every GPU this
    process sees."""
    import torch

    return {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}


def start_ray(settings: RunSettings) -> None:
    """Join the cluster that ``--ray-address`` (else ``$RAY_ADDRESS``) names, passing no resources (its nodes bring
    theirs); else start a local Ray instance listening on loopback only, with the dashboard only if asked for,
    whatever cluster ``ray start`` left behind (``/tmp/ray/ray_current_cluster``). The actors' resources are checked
    against the local instance's before it starts. Nothing if Ray is up."""
    import ray
    from ray._private import ray_constants

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    address = cluster_address(settings)
    if address:
        ray.init(address=address, log_to_driver=settings.log_rollout_steps)
        return
    # Ray turns _node_ip_address="127.0.0.1" into the machine's address and its gRPC servers bind to all
    # interfaces; with clusters off (the switch Ray reads on macOS/Windows) the node is 127.0.0.1 and every
    # server binds there. The constant is read at import, so set it too; spawned processes read the env.
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray starts its workers at nice 15 for a driver at 0: the env runners and remote learners are the driver's peers
    # here, not background work, and at 15 a runner sampling ahead (--max-staleness 1) gets next to nothing beside a
    # learner in the driver on every core, or beside other jobs on a shared machine
    os.environ.setdefault(ray_constants.RAY_WORKER_NICENESS, "0")
    resources = local_resources()
    check_resources(settings, resources)
    ray.init(address="local", num_cpus=int(resources["CPU"]), num_gpus=int(resources["GPU"]),
             object_store_memory=object_store_bytes(settings),
             include_dashboard=settings.ray_dashboard, log_to_driver=settings.log_rollout_steps)


MIN_OBJECT_STORE_BYTES = 1_000_000_000  # Ray's store for everything but the weights (metrics, batches, trees)
OBJECT_STORE_HEADROOM = 1.25  # the weights of one sync, plus room for the iteration's batch and results
HOST_SHARE_FOR_STORE = 0.5  # at most this share of the host's memory goes to the store


def object_store_bytes(settings: RunSettings, host_bytes: int | None = None) -> int:
    """The local Ray instance's object store: room for one weight sync's buckets (``policies.memory_plan.sync_bytes``:
    all of them are in the store at once while remote env runners fetch them) when the sync goes through the store
    (remote env runners or remote learners), at least 1 GB; a ``SettingsError`` when that is over half the host's
    memory (``host_bytes``, default: this machine's)."""
    from policies.memory_plan import sync_bytes
    from policies.model_shape import ModelShapeError, model_shape

    if not (settings.num_env_runners or settings.num_learners):
        return MIN_OBJECT_STORE_BYTES  # the learner copies into the driver's runner tensor to tensor
    try:
        needed = OBJECT_STORE_HEADROOM * sync_bytes(model_shape(settings.model), memory_options(settings, None))
    except ModelShapeError:
        return MIN_OBJECT_STORE_BYTES  # not yet downloaded: the store grows by spilling to disk, slowly
    host = host_bytes if host_bytes is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > HOST_SHARE_FOR_STORE * host:
        raise SettingsError(
            f"the weight sync of {settings.model} needs {needed / 2**30:.1f} GiB of Ray's object store, over half of "
            f"this host's {host / 2**30:.1f} GiB: run the env runners in this process (--num-env-runners 0 with "
            f"--num-learners 0), or on a host with more memory")
    return max(MIN_OBJECT_STORE_BYTES, int(needed))


def check_resources(settings: RunSettings, available: dict[str, float],
                    nodes: list[dict[str, float]] | None = None) -> None:
    """Fail fast, naming the options, when the actors cannot all be placed (Ray would wait forever): the
    cluster's totals (``available``) must cover every actor, and each actor must fit on one of ``nodes`` (their
    resources, when known: a GPU split over two nodes does not host a one-GPU learner); and when a joined cluster's
    devices are not this process's (``check_device_defaults``)."""
    check_device_defaults(settings, available)
    demands = actor_demands(settings)
    cpus, gpus = (sum(count * demand.get(key, 0) for _, count, demand, _ in demands) for key in ("CPU", "GPU"))
    if cpus > available.get("CPU", 0) or gpus > available.get("GPU", 0):
        raise SettingsError(
            f"the requested actors need {cpus:g} CPUs and {gpus:g} GPUs but Ray has {available.get('CPU', 0):g} "
            f"CPUs and {available.get('GPU', 0):g} GPUs: lower --num-env-runners / --num-learners, or "
            f"--num-cpus-per-env-runner / --num-cpus-per-learner / --num-gpus-per-env-runner (CPUs and an env "
            f"runner's GPU may be fractions, e.g. 0.5; a learner takes a whole GPU: two cannot share one)")
    for name, amount in (settings.env_runner_resources or {}).items():
        needed = settings.num_env_runners * amount
        if needed > available.get(name, 0):
            raise SettingsError(
                f"--env-runner-resources {name}={amount:g}: {settings.num_env_runners} env runner(s) need {needed:g} "
                f"{name} but Ray has {available.get(name, 0):g} (a node offers it with ray start --resources "
                f"'{{\"{name}\": N}}', and only a cluster joined with --ray-address has such nodes)")
    for actor, _, demand, options in demands:
        if nodes is not None and not any(all(node.get(k, 0) >= v for k, v in demand.items()) for node in nodes):
            largest = ", ".join(f"{k} {max(node.get(k, 0) for node in nodes):g}" for k in demand)
            raise SettingsError(
                f"one {actor} needs {', '.join(f'{v:g} {k}' for k, v in demand.items())} on a single node, but no "
                f"node of the cluster has that (the most any node has: {largest}): lower {options}")


def check_device_defaults(settings: RunSettings, available: dict[str, float]) -> None:
    """Refuse a joined cluster whose GPUs (``available``) disagree with this process's, which chose the device
    defaults (``experiments.settings.device_following``) when the settings were built, before Ray could say what the
    cluster holds (a GPU-less head would give a GPU cluster CPU defaults), unless every one of them was given."""
    address = cluster_address(settings)
    gpus, here = available.get("GPU", 0), algorithm_settings.gpu_visible()
    guessed = [name for name in device_following(settings) if name not in settings.model_fields_set]
    if not address or bool(gpus) == here or not guessed:
        return
    option = f"--ray-address {address}" if settings.ray_address else f"$RAY_ADDRESS {address}"
    flags = ", ".join(f"--{name.replace('_', '-')}" for name in guessed)
    raise SettingsError(
        f"{option}: the cluster has {gpus:g} GPUs but this process sees {'one' if here else 'none'}, and the "
        f"defaults that follow the device were chosen here, for {'a GPU' if here else 'the CPU'}, before Ray could "
        f"say what the cluster holds: give {flags} explicitly (--help gives each one's GPU and CPU default), or run "
        f"the driver where the cluster's devices are visible")


def node_resources() -> list[dict[str, float]]:
    """The resources of each live node of the Ray cluster this process is connected to."""
    import ray

    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def actor_demands(settings: RunSettings) -> list[tuple[str, int, dict[str, float], str]]:
    """(actor kind, how many the run starts, the resources one asks Ray for, the options that set them), for the
    kinds the run starts with a demand: what RLlib asks for (``build_config`` gives it ``num_cpus_per_learner``, so
    a learner on a GPU asks for its CPUs too)."""
    runner = {"CPU": settings.num_cpus_per_env_runner, "GPU": settings.num_gpus_per_env_runner,
              **(settings.env_runner_resources or {})}
    learner = {"CPU": settings.num_cpus_per_learner, "GPU": settings.num_gpus_per_learner}
    kinds = [("env runner", settings.num_env_runners, runner,
              "--num-cpus-per-env-runner / --num-gpus-per-env-runner / --env-runner-resources"),
             ("learner", settings.num_learners, learner, "--num-cpus-per-learner / --num-gpus-per-learner")]
    return [(actor, count, {k: v for k, v in demand.items() if v}, options) for actor, count, demand, options in kinds
            if count and any(demand.values())]
