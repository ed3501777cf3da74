"""The private (underscore or internal) APIs of Ray/RLlib, torch, transformers and vLLM that the project relies on,
each asserted to exist with the shape we use. A failure names the API, the file that uses it and what to check;
docs/private_apis.md lists the same entries with the version each was checked against. The vLLM entries are marked
``vllm`` (``make test-vllm`` runs them in .venv-vllm) and skip where vLLM is not importable."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "private_apis.md"
# the versions docs/private_apis.md was checked against (vLLM: the CPU build `make setup-vllm` installs)
CHECKED = {"ray": "2.60.0", "torch": "2.13.0", "transformers": "5.24.0", "vllm": "0.32.0"}


@dataclass(frozen=True)
class PrivateAPI:
    library: str  # ray, torch, transformers or vllm
    name: str  # as docs/private_apis.md spells it
    used_in: str  # the project's files that rely on it
    what_to_check: str  # where to look when the probe fails
    probe: Callable[[], None]  # raises AssertionError (with the detail) when the shape we use is gone


def installed_version(library: str) -> str:
    module = __import__(library)
    return str(module.__version__).split("+")[0]


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def has_var_keyword(function) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def expect(condition: bool, detail: str) -> None:
    if not condition:
        raise AssertionError(detail)


def expect_parameters(function, names: list[str]) -> None:
    found = parameters(function)
    expect(found[:len(names)] == names, f"{function.__qualname__} takes {found}, we call it with {names}")


def source_of(obj) -> str:
    return inspect.getsource(obj)


def expect_assigned(init, attribute: str) -> None:
    expect(re.search(rf"self\.{attribute}\s*(:[^=\n]*)?=", source_of(init)) is not None,
           f"{init.__qualname__} no longer sets self.{attribute}")


def expect_calls(function, call: str) -> None:
    expect(call in source_of(function), f"{function.__qualname__} no longer calls {call}...): our override is dead")


# --- Ray / RLlib ------------------------------------------------------------------------------------------------

def torch_learner():
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    return TorchLearner


def uncompiled_update() -> None:
    learner = torch_learner()
    expect_parameters(learner._uncompiled_update, ["self", "batch"])
    expect(has_var_keyword(learner._uncompiled_update), "_uncompiled_update no longer takes **kwargs")
    expect_calls(learner._update, "self._uncompiled_update(")


def get_optimizer_state() -> None:
    learner = torch_learner()
    expect_parameters(learner._get_optimizer_state, ["self"])
    expect_calls(learner.get_state, "self._get_optimizer_state(")
    expect(hasattr(learner, "_set_optimizer_state"), "TorchLearner._set_optimizer_state is gone")


def make_module_and_ddp_wrapping() -> None:
    from ray.rllib.core.learner.learner import Learner

    learner = torch_learner()
    expect_parameters(learner._make_module, ["self"])
    # a sharded learner calls Learner._make_module itself: the module built, without TorchLearner's move to the device
    expect_parameters(Learner._make_module, ["self"])
    expect_calls(learner._make_module, "self._map_module_to_device(")
    build = source_of(Learner.build)
    expect(build.index("self._make_module(") < build.index("self.configure_optimizers("),
           "Learner.build configures the optimizers before making the module: they would not hold the shards")
    expect_parameters(learner._make_modules_ddp_if_necessary, ["self"])
    expect_calls(learner.build, "self._make_modules_ddp_if_necessary(")


def get_subcomponents() -> None:
    from ray.rllib.utils.checkpoints import Checkpointable

    expect_parameters(Checkpointable._get_subcomponents, ["self", "name", "components"])


def learner_group_get_results() -> None:
    from ray.rllib.core.learner.learner_group import LearnerGroup

    expect_parameters(LearnerGroup._get_results, ["self", "results"])


def optimizer_registries() -> None:
    from ray.rllib.core.learner.learner import Learner

    expect_assigned(Learner.__init__, "_named_optimizers")
    expect_assigned(Learner.__init__, "_optimizer_name_to_module")


def set_optimizer_lr() -> None:
    learner = torch_learner()
    expect(isinstance(inspect.getattr_static(learner, "_set_optimizer_lr"), staticmethod),
           "TorchLearner._set_optimizer_lr is no longer a staticmethod")
    expect_parameters(learner._set_optimizer_lr, ["optimizer", "lr"])


def learner_device_and_module() -> None:
    from ray.rllib.core.learner.learner import Learner

    expect_assigned(Learner.__init__, "_device")
    expect_assigned(Learner.__init__, "_module")


def check_component() -> None:
    from ray.rllib.utils.checkpoints import Checkpointable

    expect_parameters(Checkpointable._check_component, ["self", "name", "components", "not_components"])


def model_config_auto_includes() -> None:
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    expect(isinstance(inspect.getattr_static(AlgorithmConfig, "_model_config_auto_includes"), property),
           "AlgorithmConfig._model_config_auto_includes is no longer a property")
    expect("_model_config_auto_includes" in source_of(inspect.getattr_static(AlgorithmConfig, "model_config").fget),
           "AlgorithmConfig.model_config no longer merges _model_config_auto_includes: our override is dead")


def make_callback() -> None:
    from ray.rllib.callbacks.utils import make_callback

    expect_parameters(make_callback, ["callback_name", "callbacks_objects", "callbacks_functions"])
    expect("kwargs" in parameters(make_callback), "make_callback no longer takes kwargs=")


def should_create_evaluation_env_runners() -> None:
    from ray.rllib.algorithms.algorithm import Algorithm

    expect(isinstance(inspect.getattr_static(Algorithm, "_should_create_evaluation_env_runners"), classmethod),
           "Algorithm._should_create_evaluation_env_runners is no longer a classmethod")
    expect_parameters(Algorithm._should_create_evaluation_env_runners, ["eval_config"])
    expect("_should_create_evaluation_env_runners(" in source_of(Algorithm.setup),
           "Algorithm.setup no longer asks _should_create_evaluation_env_runners: our override is dead")


def rl_module_forward_hooks() -> None:
    from ray.rllib.core.rl_module.rl_module import RLModule

    for hook in (RLModule._forward, RLModule._forward_train):
        expect_parameters(hook, ["self", "batch"])
        expect(has_var_keyword(hook), f"{hook.__qualname__} no longer takes **kwargs")
    expect_calls(RLModule.forward_train, "self._forward_train(")


def dashboard_dependency_error() -> None:
    from ray._private.utils import get_dashboard_dependency_error

    expect(parameters(get_dashboard_dependency_error) == [], "get_dashboard_dependency_error now takes arguments")
    result = get_dashboard_dependency_error()
    expect(result is None or isinstance(result, ImportError), f"it returned {result!r}, not None or an ImportError")


def ray_cluster_switch() -> None:
    from ray._private import ray_constants

    expect(isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTERS_ENV_VAR", None), str),
           "ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR is gone")
    expect(isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool),
           "ray_constants.ENABLE_RAY_CLUSTER is gone (or not a bool)")


def default_storage_path() -> None:
    from ray.tune.trainable import trainable

    expect(isinstance(getattr(trainable, "DEFAULT_STORAGE_PATH", None), str),
           "ray.tune.trainable.trainable.DEFAULT_STORAGE_PATH is gone")
    expect(re.search(r"dir=DEFAULT_STORAGE_PATH", source_of(trainable)) is not None,
           "Trainable no longer reads the module global DEFAULT_STORAGE_PATH when it makes its log folder")


def trainable_storage() -> None:
    from ray.train._internal.storage import StorageContext
    from ray.tune.trainable.trainable import Trainable

    expect_assigned(Trainable.__init__, "_storage")
    for name in ("trial_dir_name", "trial_fs_path", "storage_filesystem"):
        expect(name in source_of(StorageContext), f"StorageContext.{name} is gone")


def learner_group_learner() -> None:
    from ray.rllib.core.learner.learner_group import LearnerGroup

    expect_assigned(LearnerGroup.__init__, "_learner")


def env_runner_group_worker_manager() -> None:
    from ray.rllib.env.env_runner_group import EnvRunnerGroup
    from ray.rllib.utils.actor_manager import FaultTolerantActorManager

    expect_assigned(EnvRunnerGroup.__init__, "_worker_manager")
    expect(callable(getattr(FaultTolerantActorManager, "actors", None)), "FaultTolerantActorManager.actors is gone")


# --- torch ------------------------------------------------------------------------------------------------------

def mkldnn_linear() -> None:
    linear = getattr(torch._C._nn, "mkldnn_linear", None)
    expect(callable(linear), "torch._C._nn.mkldnn_linear is gone")
    if not torch.backends.mkldnn.is_available():
        return
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=generator) for shape in ((3, 4), (5, 4), (5,)))
    out = linear(x.to_mkldnn(), w.to_mkldnn(), b.to_mkldnn()).to_dense()
    expect(torch.allclose(out, torch.nn.functional.linear(x, w, b), atol=1e-5),
           "mkldnn_linear(x, weight, bias) no longer computes x @ weight.T + bias")


def tensor_version() -> None:
    tensor = torch.zeros(3)
    before = tensor._version
    tensor.add_(1)
    expect(isinstance(before, int) and tensor._version > before, "Tensor._version no longer counts in-place writes")


def graph_pool_handle() -> None:
    expect(callable(getattr(torch.cuda, "graph_pool_handle", None)), "torch.cuda.graph_pool_handle is gone")
    expect("pool" in parameters(torch.cuda.graph), "torch.cuda.graph no longer takes pool=")


def flash_attention_forward() -> None:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    expect(op is not None, "torch.ops.aten._flash_attention_forward is gone")
    schema = op.default._schema
    names = [a.name for a in schema.arguments]
    expect(names[:10] == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                          "is_causal", "return_debug_mask"] and "scale" in names,
           f"aten::_flash_attention_forward takes {names}; flash_varlen passes the first ten and scale=")
    expect(schema.returns[0].name == "output", "its first result is no longer the attention output")


# --- transformers -----------------------------------------------------------------------------------------------

def attn_implementation() -> None:
    from transformers import LlamaConfig, PreTrainedConfig

    prop = inspect.getattr_static(PreTrainedConfig, "_attn_implementation", None)
    expect(isinstance(prop, property) and prop.fset is not None,
           "PreTrainedConfig._attn_implementation is no longer a property with a setter")
    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    for implementation in ("eager", "sdpa"):
        config._attn_implementation = implementation
        expect(config._attn_implementation == implementation,
               f"setting _attn_implementation to {implementation!r} reads back {config._attn_implementation!r}")


def mask_attention_functions() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from policies.ragged_attention import ATTENTION  # registers its mask function on import

    expect(callable(getattr(ALL_MASK_ATTENTION_FUNCTIONS, "register", None)),
           "ALL_MASK_ATTENTION_FUNCTIONS has no register()")
    expect(ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS,
           f"ALL_MASK_ATTENTION_FUNCTIONS.register({ATTENTION!r}, ...) no longer makes the name known")


def chat_template_clock() -> None:
    import transformers.utils.chat_template_utils as chat_template_utils

    expect(hasattr(chat_template_utils, "datetime"), "chat_template_utils no longer imports datetime")
    expect("datetime.now()" in source_of(chat_template_utils),
           "chat_template_utils no longer reads the clock through its module global datetime (strftime_now)")


# --- vLLM -------------------------------------------------------------------------------------------------------

def vllm_module(name: str):
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")
    import importlib

    return importlib.import_module(name)


def collective_rpc_reload_weights() -> None:
    llm = vllm_module("vllm").LLM
    expect(callable(getattr(llm, "collective_rpc", None)), "LLM.collective_rpc is gone")
    expect(parameters(llm.collective_rpc)[:2] == ["self", "method"] and "kwargs" in parameters(llm.collective_rpc),
           f"LLM.collective_rpc takes {parameters(llm.collective_rpc)}, we call it with (method, kwargs=)")
    worker = vllm_module("vllm.v1.worker.gpu_worker").Worker
    expect(callable(getattr(worker, "reload_weights", None)), "the worker has no reload_weights")
    runner = getattr(vllm_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner, "reload_weights", None)
    named = [f for f in (worker.reload_weights, runner) if f is not None and "weights_iterator" in parameters(f)]
    expect(bool(named), "neither Worker.reload_weights nor GPUModelRunner.reload_weights takes weights_iterator")


def engine_requests() -> None:
    engine = vllm_module("vllm.v1.engine.llm_engine").LLMEngine
    for method in ("step", "add_request", "abort_request"):
        expect(callable(getattr(engine, method, None)), f"LLMEngine.{method} is gone")
    expect(parameters(engine.add_request)[:4] == ["self", "request_id", "prompt", "params"],
           f"LLMEngine.add_request takes {parameters(engine.add_request)}, we pass (request_id, prompt, params)")
    expect("internal" in parameters(engine.abort_request), "LLMEngine.abort_request no longer takes internal=")


def engine_core_shutdown() -> None:
    client = vllm_module("vllm.v1.engine.core_client").EngineCoreClient
    expect(callable(getattr(client, "shutdown", None)), "EngineCoreClient.shutdown is gone")


def child_request_ids() -> None:
    parent = vllm_module("vllm.v1.engine.parallel_sampling").ParentRequest
    expect('f"{index}_{' in source_of(parent),
           "ParentRequest no longer names a child request f'{index}_{parent id}'")


def request_output_cached_tokens() -> None:
    output = vllm_module("vllm").RequestOutput
    expect("num_cached_tokens" in parameters(output.__init__), "RequestOutput no longer carries num_cached_tokens")


LEARNER = "algos/tree_grpo/learner.py"
LEARNER_STATE = "algos/tree_grpo/learner_state.py"
LEARNER_GROUP = "algos/tree_grpo/learner_group.py"
APIS = [
    PrivateAPI("ray", "TorchLearner._uncompiled_update", LEARNER,
               "RLlib's TorchLearner._update: our override replaces its row-split update loop", uncompiled_update),
    PrivateAPI("ray", "TorchLearner._get_optimizer_state", LEARNER_STATE,
               "Learner.get_state / _set_optimizer_state: our override returns tensors (numpy has no bf16)",
               get_optimizer_state),
    PrivateAPI("ray", "Learner._named_optimizers / _optimizer_name_to_module", LEARNER_STATE,
               "Learner.__init__ and register_optimizer: where the optimizers and their module ids are kept",
               optimizer_registries),
    PrivateAPI("ray", "TorchLearner._make_module", LEARNER,
               "Learner.build: the module is made before the optimizers, so that AdamW is built over the shards",
               make_module_and_ddp_wrapping),
    PrivateAPI("ray", "TorchLearner._make_modules_ddp_if_necessary", LEARNER,
               "TorchLearner.build calls it last: a sharded module must not also be wrapped in DDP",
               make_module_and_ddp_wrapping),
    PrivateAPI("ray", "Checkpointable._get_subcomponents", LEARNER_GROUP,
               "ray.rllib.utils.checkpoints: the learner's part of a learner-group state request", get_subcomponents),
    PrivateAPI("ray", "LearnerGroup._get_results", LEARNER_GROUP,
               "LearnerGroup: the values of a foreach_learner call, the first error raised", learner_group_get_results),
    PrivateAPI("ray", "Learner._set_optimizer_lr", LEARNER,
               "TorchLearner: how a learning rate is written into an optimizer's param groups", set_optimizer_lr),
    PrivateAPI("ray", "Learner._device / Learner._module", LEARNER,
               "Learner.__init__ and build(): the learner's device and MultiRLModule", learner_device_and_module),
    PrivateAPI("ray", "Checkpointable._check_component",
               f"{LEARNER_STATE}, {LEARNER_GROUP}, algos/tree_grpo/env_runner.py",
               "ray.rllib.utils.checkpoints: how get_state decides whether a component is asked for",
               check_component),
    PrivateAPI("ray", "Algorithm._should_create_evaluation_env_runners", "algos/tree_grpo/tree_grpo.py",
               "Algorithm.setup: how it decides to build a second (evaluation) EnvRunnerGroup",
               should_create_evaluation_env_runners),
    PrivateAPI("ray", "AlgorithmConfig._model_config_auto_includes", "algos/tree_grpo/tree_grpo.py (override)",
               "AlgorithmConfig.model_config: the algorithm's keys merged under the user's model_config",
               model_config_auto_includes),
    PrivateAPI("ray", "ray.rllib.callbacks.utils.make_callback", "algos/tree_grpo/tree_grpo.py",
               "Algorithm.evaluate: how it calls on_evaluate_start and on_evaluate_end", make_callback),
    PrivateAPI("ray", "RLModule._forward / RLModule._forward_train", "policies/rl_module.py",
               "RLModule.forward_train: the hooks a module implements", rl_module_forward_hooks),
    PrivateAPI("ray", "ray._private.utils.get_dashboard_dependency_error", "experiments/settings.py",
               "ray/_private/utils.py and how ray.init checks the dashboard's packages", dashboard_dependency_error),
    PrivateAPI("ray", "ray._private.ray_constants.ENABLE_RAY_CLUSTER(S_ENV_VAR)",
               "experiments/preflight.py, tests/test_local_ray.py",
               "ray/_private/ray_constants.py: the switch that binds a local node to 127.0.0.1", ray_cluster_switch),
    PrivateAPI("ray", "ray.tune.trainable.trainable.DEFAULT_STORAGE_PATH", "tests/conftest.py",
               "Trainable's default log folder (~/ray_results): the tests point it into their temporary folder",
               default_storage_path),
    PrivateAPI("ray", "Trainable._storage (StorageContext)", "experiments/tracking.py",
               "Trainable.__init__ and ray/train/_internal/storage.py: a Tune trial's directory name and where its "
               "files are kept", trainable_storage),
    PrivateAPI("ray", "LearnerGroup._learner", "tests/test_algorithm.py, tests/test_env_runners.py, tests/test_vllm.py",
               "LearnerGroup.__init__: the local learner of a group with num_learners=0", learner_group_learner),
    PrivateAPI("ray", "EnvRunnerGroup._worker_manager", "tests/test_env_runners.py",
               "EnvRunnerGroup.__init__ and FaultTolerantActorManager.actors(): the remote runners' actor handles",
               env_runner_group_worker_manager),
    PrivateAPI("torch", "torch._C._nn.mkldnn_linear", "policies/packed_linear.py",
               "torch's oneDNN linear (aten mkldnn_linear): the CPU rollout's packed-weight matmul", mkldnn_linear),
    PrivateAPI("torch", "Tensor._version", "policies/packed_linear.py",
               "the version counter autograd keeps: the packed-weight cache is invalidated by it", tensor_version),
    PrivateAPI("torch", "torch.cuda.graph_pool_handle", "policies/static_decode.py",
               "torch.cuda.graphs: a fresh graph memory pool after the KV pool grows", graph_pool_handle),
    PrivateAPI("torch", "torch.ops.aten._flash_attention_forward", "policies/ragged_attention.py",
               "aten's flash-attention forward in its variable-length form (cum_seq_q / cum_seq_k): the GPU engine's "
               "prefill attention", flash_attention_forward),
    PrivateAPI("transformers", "PreTrainedConfig._attn_implementation",
               "policies/logprobs.py, policies/ragged_attention.py, tests/test_learner.py",
               "transformers' configuration_utils: the attention implementation a model runs (and its setter, "
               "which reaches sub-configs)", attn_implementation),
    PrivateAPI("transformers", "transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS",
               "policies/ragged_attention.py",
               "transformers' masking_utils: registering the mask function of a custom attention",
               mask_attention_functions),
    PrivateAPI("transformers", "transformers.utils.chat_template_utils.datetime", "tests/test_tiny_models.py",
               "strftime_now in chat_template_utils: the clock the Llama-3.2 template reads", chat_template_clock),
    PrivateAPI("vllm", 'LLM.collective_rpc("reload_weights")', "policies/vllm_generation.py",
               "vLLM's worker / model runner reload_weights: the in-place weight sync", collective_rpc_reload_weights),
    PrivateAPI("vllm", "LLMEngine.step / add_request / abort_request(internal=)", "policies/vllm_generation.py",
               "vllm/v1/engine/llm_engine.py: the engine-level request loop under LLM", engine_requests),
    PrivateAPI("vllm", "llm_engine.engine_core.shutdown", "policies/vllm_generation.py",
               "vllm/v1/engine/core_client.py: freeing an in-process engine", engine_core_shutdown),
    PrivateAPI("vllm", "child request ids {index}_{parent}", "policies/vllm_generation.py",
               "vllm/v1/engine/parallel_sampling.py: the ids abort_request takes for an n > 1 request's samples",
               child_request_ids),
    PrivateAPI("vllm", "RequestOutput.num_cached_tokens", "policies/vllm_generation.py",
               "vllm/outputs.py: the prompt tokens served from the prefix cache (tokens_prefilled)",
               request_output_cached_tokens),
]


def failure(api: PrivateAPI, detail: str) -> str:
    return (f"{api.library} private API {api.name} changed ({detail}). Used in {api.used_in}. What to check: "
            f"{api.what_to_check}. Checked against {api.library} {CHECKED[api.library]}, installed "
            f"{installed_version(api.library)}; update docs/private_apis.md with the fix.")


@pytest.mark.parametrize("api", [pytest.param(api, id=api.name, marks=[pytest.mark.vllm] * (api.library == "vllm"))
                                 for api in APIS])
def test_private_api_still_has_the_shape_we_use(api):
    detail = None
    try:
        api.probe()
    except (AssertionError, AttributeError, ImportError, TypeError, ValueError, OSError) as error:
        detail = f"{type(error).__name__}: {error}"
    if detail is not None:  # outside the except: the message alone, no chained traceback
        pytest.fail(failure(api, detail), pytrace=False)


def test_every_private_api_is_in_the_doc():
    text = DOC.read_text()
    missing = [api.name for api in APIS if f"`{api.name}`" not in text]
    assert not missing, f"docs/private_apis.md does not list {missing}: add a row for each (library, use, version)"


# dotted paths of a library with a private component, e.g. ``ray._private.utils`` or ``torch._C._nn.mkldnn_linear``
LIBRARY_PATH = re.compile(r"\b(?:ray|torch|transformers|vllm)(?:\.\w+)+")
FROM_IMPORT = re.compile(r"^\s*from\s+((?:ray|torch|transformers|vllm)(?:\.\w+)+)\s+import\s+\(?([\w\s,]+)", re.M)
SOURCE_FOLDERS = ("algos", "benchmarks", "envs", "experiments", "policies", "tests")


def private_paths(text: str) -> set[str]:
    """The library paths in ``text`` through a private (underscore) component; ``from X import a`` gives ``X.a``."""
    paths = {match.group(0) for match in LIBRARY_PATH.finditer(text)}
    for match in FROM_IMPORT.finditer(text):
        paths.discard(match.group(1))
        paths |= {f"{match.group(1)}.{name.split()[0]}" for name in match.group(2).split(",") if name.strip()}
    return {path for path in paths
            if any(part.startswith("_") and not part.endswith("__") for part in path.split(".")[1:])}


def test_no_unlisted_private_library_path():
    """A new ``ray._private...`` / ``torch._C...`` path in the code must be added to APIS (and to the doc)."""
    listed = [api.name for api in APIS]
    files = [path for folder in SOURCE_FOLDERS for path in (ROOT / folder).rglob("*.py")] + list(ROOT.glob("*.py"))
    unlisted = {}
    for path in files:
        if path == Path(__file__).resolve():
            continue
        for private in private_paths(path.read_text()):
            if not any(name == private or name.startswith(private + ".") for name in listed):
                unlisted.setdefault(private, str(path.relative_to(ROOT)))
    assert not unlisted, f"private library paths not in tests/test_private_apis.py's APIS: {unlisted}"
