"""The weight sync from the learner to two env runners' modules: buckets (``algos/tree_grpo/weight_transport.py``)
against the whole state dict through RLlib's path (the code before the buckets), in one run.

    python benchmarks/bench_weight_sync.py                          # SmolLM2-135M's shape, float32 and bf16
    python benchmarks/bench_weight_sync.py --report docs/benchmarks.md

Processes as in a run: the learner's module (float32 master weights) in the driver (``--num-learners 0``) or in a
Ray actor (``--num-learners 1``), two Ray actors holding an env runner's inference-only module (the compute
dtype), all modules ``LLMRLModule``s around a random model of the shape. And the colocated case: the learner and
the one runner in the driver (``--num-learners 0 --num-env-runners 0``).

State dict (the old path, RLlib's ``sync_weights``, measured by calling the same functions): the learner's
``get_state(inference_only=True)`` (every state-dict tensor, a tied one under both names, cast to the compute
dtype), from a remote learner returned to the driver, ``ray.put`` of the dict in the driver, each runner's
``set_state``: ``module.set_state`` (``load_state_dict``); colocated, ``set_state`` of the learner's state
directly. Buckets: ``put_weights`` in the learner's process (buckets of ``--bucket-mib``, each tensor once, each
put in the object store as it is made), the refs to the runners, each runner's ``receive_weights`` (a zero-copy
get, a copy into its parameters); colocated, ``sync_in_process`` (in float32 the engine shares the learner's
parameters: no copy; in bf16 a cast copy into its own).

Measured per path: seconds from the start of the learner's part until every runner has loaded (median of
``--repeats`` after a warm-up round), and the peak host memory the sync adds to each process (``VmHWM`` reset
before, minus the resident set before). Bytes moved are counted per step from the tensors' sizes (see
:func:`bytes_moved`): every host write of the weights' bytes (a cast, a serialisation, a store, a
deserialisation, the load into the parameters); the state dict's object-store size is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from algos.tree_grpo.weight_transport import put_weights, receive_weights
from benchmarks.gpu_check import random_model
from benchmarks.report import machine_description, replace_section
from envs.search_qa import UnicodeText
from policies.memory import peak_memory_gib, reset_peak_memory
from policies.model_shape import PRESETS, SMOLLM2
from policies.rl_module import LLMRLModule
from policies.weight_sync import sync_in_process, tensor_specs

MIB = 2**20
RUNNERS = 2
SECTION_KEY, SECTION_TITLE = "weight-sync", "Weight sync: buckets against the state dict (CPU)"
LAYOUTS = ("local learner, 2 runners", "remote learner, 2 runners", "colocated")


def build_module(shape: str, dtype: str, *, inference_only: bool, bucket_mib: float) -> LLMRLModule:
    """An ``LLMRLModule`` (compute ``dtype``) around a random model of ``shape``, in the dtype its role holds."""
    spec = RLModuleSpec(module_class=LLMRLModule, observation_space=UnicodeText(8), action_space=UnicodeText(8),
                        inference_only=inference_only,
                        model_config={"model": "tiny-random", "dtype": dtype, "sync_bucket_mib": bucket_mib})
    module = spec.build()
    held = getattr(torch, dtype) if inference_only else torch.float32
    module.model = random_model(PRESETS[shape], "cpu").to(held).eval()
    return module


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmRSS (Linux only)")


class PeakMemory:
    """The peak resident set a stretch of this process adds: ``reset`` before it, ``added_mib`` after."""

    def __init__(self):
        self.before = 0.0

    def reset(self) -> None:
        gc.collect()
        self.before = resident_mib()
        reset_peak_memory("cpu")

    def added_mib(self) -> float:
        return peak_memory_gib("cpu") * 1024 - self.before


class Process:
    """A process of the benchmark: holds a module in its role, and its peak memory."""

    def __init__(self, shape: str, dtype: str, inference_only: bool, bucket_mib: float):
        torch.manual_seed(0)
        self.module = build_module(shape, dtype, inference_only=inference_only, bucket_mib=bucket_mib)
        self.peak = PeakMemory()

    def reset_peak(self) -> None:
        self.peak.reset()

    def added_peak_mib(self) -> float:
        return self.peak.added_mib()

    # the learner's part
    def state_dict_weights(self) -> dict[str, Any]:
        return {COMPONENT_RL_MODULE: self.module.get_state(inference_only=True), WEIGHTS_SEQ_NO: 1}

    def bucket_weights(self):
        return put_weights(self.module, 1)

    # a runner's part
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.set_state(state[COMPONENT_RL_MODULE])

    def load_buckets(self, weights) -> None:
        receive_weights(self.module, weights)


RemoteProcess = ray.remote(num_cpus=0)(Process)


def sync_once(path: str, layout: str, learner: Process | Any, runners: list[Any]) -> None:
    """One sync along ``path`` ("state dict" or "buckets") in ``layout``, until every runner has loaded."""
    remote_learner = layout.startswith("remote")
    if layout == "colocated":
        (runner,) = runners
        if path == "buckets":
            sync_in_process(learner.module.model, runner.module.model)
        else:
            runner.load_state_dict(learner.state_dict_weights())
        return
    if path == "buckets":
        weights = ray.get(learner.bucket_weights.remote()) if remote_learner else learner.bucket_weights()
        ray.get([runner.load_buckets.remote(weights) for runner in runners])
    else:
        state = ray.get(learner.state_dict_weights.remote()) if remote_learner else learner.state_dict_weights()
        reference = ray.put(state)
        ray.get([runner.load_state_dict.remote(reference) for runner in runners])


def bytes_moved(path: str, layout: str, sizes: dict[str, int], cast: bool) -> dict[str, int]:
    """Bytes written per sync, per step: ``sizes["state"]``: the state dict in the compute dtype (a tied tensor
    twice), ``sizes["unique"]``: each tensor once. A CPU learner's ``.cpu()`` is no copy; a float32 compute dtype
    is no cast. Pickling a torch tensor (Ray's default for tensors) writes it with ``torch.save`` into a buffer,
    then into the pickle stream, then Ray stores the stream; unpickling copies the stream's bytes out and
    ``torch.load`` copies them into a new storage (a numpy array travels out of band: one write into the store,
    a zero-copy view out)."""
    state, unique = sizes["state"], sizes["unique"]
    if layout == "colocated":
        if path == "buckets":
            return ({"copy into the engine's parameters (cast fused)": unique} if cast else
                    {"none: the engine holds the learner's parameters": 0})
        return {"cast to the compute dtype": state if cast else 0, "load_state_dict": state}
    runners = RUNNERS
    if path == "buckets":
        return {"cast into the buckets": unique, "object-store put (out of band)": unique,
                "runners' copy into their parameters": runners * unique}
    steps = {"cast to the compute dtype": state if cast else 0}
    if layout.startswith("remote"):
        steps["learner -> driver: pickling (torch.save, stream, store)"] = 3 * state
        steps["learner -> driver: unpickling (bytes, torch.load)"] = 2 * state
    steps["driver's put: pickling (torch.save, stream, store)"] = 3 * state
    steps["runners' unpickling (bytes, torch.load)"] = runners * 2 * state
    steps["runners' load_state_dict"] = runners * state
    return steps


def measure(layout: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both paths in ``layout`` at compute ``dtype``: seconds, bytes, peaks."""
    learner_args = (args.shape, dtype, False, args.bucket_mib)
    runner_args = (args.shape, dtype, True, args.bucket_mib)
    if layout == "colocated":
        learner, runners = Process(*learner_args), [Process(*runner_args)]
    else:
        learner = RemoteProcess.remote(*learner_args) if layout.startswith("remote") else Process(*learner_args)
        runners = [RemoteProcess.remote(*runner_args) for _ in range(RUNNERS)]
    local = [p for p in (learner, *runners) if isinstance(p, Process)]
    remote = [p for p in (learner, *runners) if not isinstance(p, Process)]
    driver = PeakMemory() if layout.startswith("remote") else None  # the driver's hop of a remote learner's state
    model = build_module(args.shape, dtype, inference_only=False, bucket_mib=args.bucket_mib).model
    item = getattr(torch, dtype).itemsize
    sizes = {"state": sum(t.numel() for t in model.state_dict().values()) * item,
             "unique": sum(spec.numel for spec in tensor_specs(model)) * item}
    del model
    state_store = len(ray.cloudpickle.dumps(local[0].state_dict_weights())) if layout.startswith("local") else None
    rows = {}
    for path in ("state dict", "buckets"):
        seconds, peaks = [], []
        for repeat in range(args.repeats + 1):
            for process in local:
                process.reset_peak()
            ray.get([process.reset_peak.remote() for process in remote])
            if driver:
                driver.reset()
            start = time.perf_counter()
            sync_once(path, layout, learner, runners)
            elapsed = time.perf_counter() - start
            added = ([p.added_peak_mib() for p in local] + ray.get([p.added_peak_mib.remote() for p in remote])
                     + ([driver.added_mib()] if driver else []))
            if repeat:  # the first round warms the object store and the allocators up
                seconds.append(elapsed)
                peaks.append(added)
        moved = bytes_moved(path, layout, sizes, cast=dtype != "float32")
        rows[path] = {"seconds": statistics.median(seconds), "bytes": sum(moved.values()), "steps": moved,
                      "peak_mib": [max(p[i] for p in peaks) for i in range(len(peaks[0]))]}
    for process in remote:
        ray.kill(process)
    return {"layout": layout, "dtype": dtype, "sizes": sizes, "state_store_bytes": state_store,
            **rows}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| layout | compute dtype | path | seconds | bytes moved (MiB) | peak added per process (MiB: learner, "
             "runners, the driver of a remote learner) | bytes, seconds vs state dict | target met |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        old, new = result["state dict"], result["buckets"]
        bytes_ratio, time_ratio = new["bytes"] / old["bytes"], new["seconds"] / old["seconds"]
        for path, row in (("state dict", old), ("buckets", new)):
            ratio = f"{bytes_ratio:.2f}x, {time_ratio:.2f}x" if path == "buckets" else ""
            met = ("yes" if bytes_ratio <= 0.5 and time_ratio <= 0.5 else "no") if path == "buckets" else ""
            peaks = ", ".join(f"{p:.0f}" for p in row["peak_mib"])
            lines.append(f"| {result['layout']} | {result['dtype']} | {path} | {row['seconds']:.3f} | "
                         f"{row['bytes'] / MIB:.0f} | {peaks} | {ratio} | {met} |")
    return "\n".join(lines)


def steps_text(results: list[dict[str, Any]]) -> str:
    lines = []
    for result in results:
        if result["dtype"] != "bfloat16":
            continue
        for path in ("state dict", "buckets"):
            steps = "; ".join(f"{name} {value / MIB:.0f}" for name, value in result[path]["steps"].items())
            lines.append(f"- {result['layout']}, {path}: {steps}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=SMOLLM2, choices=sorted(PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--bucket-mib", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--object-store-mib", type=int, default=1536)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--report", help="rewrite this section of a markdown file (docs/benchmarks.md)")
    args = parser.parse_args()
    ray.init(num_cpus=2, object_store_memory=args.object_store_mib * MIB, include_dashboard=False,
             log_to_driver=False)
    results = []
    for layout in args.layouts:
        for dtype in args.dtypes:
            results.append(measure(layout, dtype, args))
            print(json.dumps(results[-1]), flush=True)
    ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.report:
        body = (f"`python benchmarks/bench_weight_sync.py --report docs/benchmarks.md` (shape {args.shape}, "
                f"buckets of {args.bucket_mib:g} MiB, median of {args.repeats} after a warm-up).\n"
                f"Machine: {machine_description(('torch', 'ray', 'numpy'))}.\n\n{table(results)}\n\n"
                f"Bytes moved per step (MiB, bf16):\n\n{steps_text(results)}\n")
        replace_section(args.report, SECTION_KEY, SECTION_TITLE, body)


if __name__ == "__main__":
    main()
