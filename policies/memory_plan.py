"""A memory plan before a run: GiB per GPU for the learner's weights, gradients, optimizer state, the frozen KL
reference, the activations of one micro-batch and a colocated rollout engine, from the model's config shape alone
(``policies/model_shape.py``; no weights are read, nothing is allocated; no torch, no Ray). This file holds the
options (:class:`MemoryOptions`), the arithmetic of each part and :func:`plan_memory`; ``policies/memory_report.py``
puts a plan in words and ``policies/memory_fit.py`` says what would make one fit.

What is modelled, per GPU (``P``: parameters; bytes per parameter in brackets):

- **Weights.** bf16 mixed precision (``--dtype bfloat16``, the default for a GPU): float32 master weights [4] plus
  the bf16 copies ``torch.autocast`` casts each weight to and keeps cached while a forward/backward runs [2].
  ``--pure-bf16``: bf16 weights [2], no copies. float32: [4]. LoRA: the frozen base in the compute dtype plus the
  float32 adapters (rank R on q, k, v and o).
- **Gradients** in the trained parameters' dtype [4, pure bf16 2]; with DDP over K > 1 learners a second copy in
  the reducer's buckets (RLlib passes no ``torch_ddp_kwargs``, so ``gradient_as_bucket_view`` is off).
- **Optimizer**: AdamW's two moments in the trained parameters' dtype [8, pure bf16 4].
- **Reference**: the frozen KL reference in the compute dtype [2 in bf16, 4 in float32] on the GPU; 0 with
  ``--reference-offload`` except during its no-gradient pass (below); none with LoRA (the reference is the base
  with its adapters off) or without a KL term.
- **Activations** of one micro-batch of N decoder tokens (:func:`activation_bytes` says what is counted).
- **Rollout engine**, only when colocated on the learner's GPU: ``hf``, a compute-dtype copy of the weights plus
  its KV pool: a row per branch decoded at once, each up to the context cap (:func:`kv_cache_bytes`); the branches
  decoded at once are the engine's prompts x M in the first chains and x M x N in an expansion round
  (:func:`rollout_sequences`; the GPU defaults' 32 prompts x 2 x 2 = 128, at most the engine's 256 rows), each up
  to 4,096 tokens of context. The trees' own cache segments (``policies.kv_cache.KVSegment``: every token of the
  trees once, kept until the rollout ends) are not counted beside the rows (not yet measured on a GPU).
  ``vllm``, its ``gpu_memory_utilization`` share of the GPU (default 0.5, as
  ``policies.vllm_generation.VLLMSettings``), during rollouts only when the engine sleeps through updates.
- **Overhead**: a fixed 1 GiB per GPU for the CUDA context, cuBLAS/NCCL workspaces and the caching allocator's
  fragmentation (0 when planning for the CPU).
- **FSDP** (``sharding="fsdp"``, the sharded learners; ``policies/fsdp.py``): weights, gradients, optimizer and a
  resident reference divided by K; plus the parameters gathered for compute, in the compute dtype (FSDP's mixed
  precision gathers bf16 and runs without autocast, so no autocast copies and bf16 activations):
  two decoder layers and the root unit (embeddings, LM head), which stays gathered around a whole pass
  (:func:`fsdp_gathered_bytes`); in the backward, the full-size gradients before their reduce-scatter: the root's
  (alive from the LM head's backward to the pass's end) and one layer's, with its float32 cast for the reduction
  (:func:`fsdp_unsharded_gradient_bytes`). Every micro-batch is reduce-scattered, so no whole-model gradient is
  ever held. An offloaded reference stays sharded on the host; its units come in one by one.
- **The weight sync** (host memory, not the GPU's): :func:`sync_bytes`, the compute-dtype weights, which sit in Ray's
  object store at once when remote env runners fetch them (``experiments/preflight.py`` sizes the store from it).

The total is the maximum over the phases of an iteration: the update's forward and backward (weights with
autocast's copies, gradients, optimizer, a resident reference, the activations); its optimizer step (torch's AdamW
on a GPU runs ``foreach``, which takes the square roots of all second moments at once: one more copy of the trained
parameters, counted in the optimizer row; on the CPU it runs per tensor); the no-gradient passes before the update
(old and reference log-probs: an offloaded reference is brought in then, while no gradients exist, which assumes
the learner frees them at the end of each update); and, with a sleeping vLLM engine, the rollout (the engine awake,
the learner's weights and optimizer state kept, no gradients). The parts reported are those of the phase that peaks.

The learner's build is a phase too (:func:`startup_parts`): with FSDP the policy is sharded unit by unit from the
host and the reference made from its shards, so it peaks at the shards plus one unit whole.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from policies.model_shape import ModelShape

GIB = 2**30
CUDA_OVERHEAD_GIB = 1.0
# A plan fits when it is within this share of the GPU's memory: the plan was within 15% of measured peaks, and the
# caching allocator's fragmentation grows with the run; the rest is headroom.
USABLE_SHARE = 0.9
DEFAULT_MICRO_BATCH_TOKENS = 10_000  # a (2,2,1) prompt group at 500-token steps is 7-10k unique tokens
# Scored positions per LM-head chunk (policies.logprobs), whatever the rows: one chunk's float32 [C, V] tensors are the
# head's memory (1,024 x 152k vocabulary x 4 bytes = 0.6 GiB each), so the chunk is bounded by positions, not rows.
HEAD_CHUNK_POSITIONS = 1024
# The GPU defaults' rollout (algos.tree_grpo.settings): 32 prompts of (M, N, L) = (2, 2, 1) trees, 4,096-token contexts
DEFAULT_ROLLOUT_PROMPTS, DEFAULT_TREE, DEFAULT_ROLLOUT_CONTEXT = 32, (2, 2, 1), 4096
HF_MAX_ROWS = 256  # policies.hf_generation.EngineLimits.max_rows: branches beyond it wait for a row
DEFAULT_VLLM_GPU_MEMORY_UTILIZATION = 0.5  # policies.vllm_generation.VLLMSettings.gpu_memory_utilization
PARTS = ("weights", "gradients", "optimizer", "reference", "activations", "rollout_engine", "overhead")
# Live [C, V] float32 tensors of one LM-head chunk at the backward's peak: the recomputed log-softmax and its exp
# (saved for the entropy), and the gradients flowing through them (of the entropy, of the gather, of the softmax).
HEAD_BACKWARD_CHUNKS = 5
HEAD_FORWARD_CHUNKS = 4  # logits, log-softmax, its exp and their product: a no-gradient pass's chunk
# A checkpointed layer's backward holds its recomputed activations and, besides them, the gradients in flight
# through it: measured at about 13% of the activations (SmolLM2-135M's layers with a 1,024-token vocabulary, so that
# the layers and not the LM head set the peak; float32, 4,000 tokens, on the CPU), rounded up.
LAYER_BACKWARD_EXTRA = 0.15


def rollout_sequences(prompts: int, tree: tuple[int, int, int]) -> int:
    """The most branches an engine sampling ``prompts`` prompts of (M, N, L) trees decodes at once
    (``algos.rollout``: every tree's M first chains start together, then each of its expansion rounds runs N
    branches at once): prompts x M x N with expansion rounds (N >= 1, L >= 1), prompts x M without (chain GRPO's
    group is M)."""
    m, n, rounds = tree
    return prompts * m * (max(n, 1) if rounds else 1)


DEFAULT_ROLLOUT_SEQUENCES = rollout_sequences(DEFAULT_ROLLOUT_PROMPTS, DEFAULT_TREE)


@dataclass(frozen=True)
class MemoryOptions:
    """How the run trains (the run.py options of the same names). ``dtype``: the compute dtype; bfloat16 is
    mixed precision over float32 master weights unless ``pure_bf16``. ``micro_batch_tokens``: decoder tokens of
    one forward/backward pass; ``sequence_tokens``: the longest packed segment (row) among them, which sizes the
    dense tree mask (default: one segment of ``micro_batch_tokens``); ``head_chunk_tokens``: positions per
    LM-head chunk. ``reference``: a KL term (kl_coef > 0). ``rollout_sequences``: the branches a colocated engine
    decodes at once (:func:`rollout_sequences`), each up to ``rollout_context`` tokens: its KV cache.
    ``overhead_gib``: fixed per GPU (0 to plan for the CPU). ``gpu_memory_gib``: the GPU's memory, for ``fits``
    (None: not judged; a plan fits within :data:`USABLE_SHARE` of it)."""

    learners: int = 1
    sharding: Literal["ddp", "fsdp"] = "ddp"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    pure_bf16: bool = False
    gradient_checkpointing: bool = False
    reference: bool = True
    reference_offload: bool = False
    lora_rank: int | None = None
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS
    sequence_tokens: int | None = None
    head_chunk_tokens: int = HEAD_CHUNK_POSITIONS
    learner_attention: Literal["sdpa", "flex_attention"] = "sdpa"
    generator: Literal["hf", "vllm"] = "hf"
    colocated: bool = False
    vllm_gpu_memory_utilization: float = DEFAULT_VLLM_GPU_MEMORY_UTILIZATION
    vllm_sleep: bool = False
    rollout_sequences: int = DEFAULT_ROLLOUT_SEQUENCES
    rollout_context: int = DEFAULT_ROLLOUT_CONTEXT
    overhead_gib: float = CUDA_OVERHEAD_GIB
    gpu_memory_gib: float | None = None

    def __post_init__(self) -> None:
        if self.learners < 1:
            raise ValueError(f"learners must be at least 1, got {self.learners}")
        if self.sharding not in ("ddp", "fsdp"):
            raise ValueError(f"sharding must be ddp or fsdp, got {self.sharding!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")
        if self.pure_bf16 and self.dtype != "bfloat16":
            raise ValueError("pure_bf16 needs dtype bfloat16 (bf16 master weights)")
        if self.reference_offload and self.lora_rank is not None:
            raise ValueError("reference_offload: with LoRA the reference is the base model with its adapters off, "
                             "already on the GPU for training: there is nothing to offload")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"lora_rank must be at least 1, got {self.lora_rank}")
        if self.micro_batch_tokens < 1 or self.head_chunk_tokens < 1:
            raise ValueError("micro_batch_tokens and head_chunk_tokens must be at least 1")
        if self.rollout_sequences < 1 or self.rollout_context < 1:
            raise ValueError("rollout_sequences and rollout_context must be at least 1")
        if self.generator not in ("hf", "vllm"):
            raise ValueError(f"generator must be hf or vllm, got {self.generator!r}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError("vllm_gpu_memory_utilization must be in (0, 1]")
        if self.colocated and self.generator == "vllm" and self.gpu_memory_gib is None:
            raise ValueError("a colocated vLLM engine takes a share of the GPU's memory: give gpu_memory_gib")


@dataclass(frozen=True)
class MemoryPlan:
    """GiB per GPU: ``parts`` (:data:`PARTS`) of the phase that peaks (``phase``), their sum ``per_gpu_gib``,
    each phase's total (``phases``), and whether it fits the GPU, within :data:`USABLE_SHARE` of its memory (None
    when no GPU memory was given)."""

    model: str
    parameters: int
    parts: dict[str, float]
    per_gpu_gib: float
    phase: str
    phases: dict[str, float]
    fits: bool | None
    gpu_memory_gib: float | None
    options: MemoryOptions = field(repr=False)
    shape: ModelShape = field(repr=False)

    @property
    def usable_gib(self) -> float | None:
        """The GPU's memory a plan may fill (:data:`USABLE_SHARE` of it), or None."""
        return None if self.gpu_memory_gib is None else USABLE_SHARE * self.gpu_memory_gib

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON: ``per_gpu_gib``, ``parts``, ``fits``, and what it was planned for."""
        return {"model": self.model, "parameters": self.parameters, "per_gpu_gib": round(self.per_gpu_gib, 3),
                "sync_gib": round(sync_bytes(self.shape, self.options) / GIB, 3),
                "parts": {k: round(v, 3) for k, v in self.parts.items()}, "fits": self.fits,
                "gpu_memory_gib": self.gpu_memory_gib, "usable_gib": self.usable_gib, "peak_phase": self.phase,
                "phases": {k: round(v, 3) for k, v in self.phases.items()}, "options": asdict(self.options)}


def _compute_bytes(options: MemoryOptions) -> int:
    return 2 if options.dtype == "bfloat16" else 4


def _mixed(options: MemoryOptions) -> bool:
    """bf16 compute over float32 weights (full fine-tuning or LoRA's float32 adapters)."""
    return options.dtype == "bfloat16" and not options.pure_bf16


def _autocast(options: MemoryOptions) -> bool:
    """bf16 compute under ``torch.autocast`` (DDP and one learner). FSDP gathers the parameters in bf16 instead and
    runs without autocast: its activations are those of bf16 weights (a bf16 residual stream), as pure bf16's."""
    return _mixed(options) and options.sharding == "ddp"


def layer_activation_bytes(shape: ModelShape, options: MemoryOptions) -> float:
    """Bytes one decoder layer keeps for its backward per token of a micro-batch, as counted with autograd's
    saved-tensor hooks on HF's Llama (sdpa) and summed by storage:

    - the two RMSNorms compute in float32: each keeps its float32 input (the residual stream; the layer's input
      for the first) and the normalized tensor; in float32 also the weighted output, in pure bf16 the normalized
      and weighted outputs in bf16; under autocast the weighted output is float32 and not kept, but each of the
      five projections it feeds (q, k, v; gate, up) keeps its own bf16 cast of it;
    - q and k after the rotary embedding, v, and the attention output (the o projection's input), in the compute
      dtype; the attention kernel keeps no scores (a fused kernel), only its log-sum-exp (heads floats);
    - with sdpa and a mask (the shared-prefix tree mask; transformers then repeats k and v to every head for
      grouped-query attention) k and v have ``q_dim`` each, and the mask is converted to the compute dtype and
      kept per layer: ``sequence_tokens`` values per token; flex_attention takes grouped heads and a block mask
      (a per-row forward of unpadded rows keeps no mask either; the plan counts the prefix-sharing default's);
    - the MLP's gate and up outputs, the activation and the product, in the compute dtype (4 x intermediate);
    - two float32 inverse RMS values.

    With LoRA the frozen projections keep no inputs (their input gradients need only their weights): the norms
    keep their float32 input only; the adapters on q, k, v keep their input (float32: the norm's output, shared;
    bf16: a cast each) and the one on o a copy of the attention output (peft casts it to the adapters' float32,
    autocast back); the MLP keeps gate, up and the activation (3 x intermediate); each adapter keeps its rank-r
    intermediate. The rest as above (measured the same way: bf16 base, float32 adapters, under autocast).
    """
    c = _compute_bytes(options)
    h = shape.hidden
    sdpa = options.learner_attention == "sdpa"
    kv = shape.q_dim if sdpa and shape.kv_heads != shape.heads else shape.kv_dim
    attention = c * (2 * shape.q_dim + 2 * kv) + 4 * shape.heads
    mask = c * (options.sequence_tokens or options.micro_batch_tokens) if sdpa else 0
    if options.lora_rank is not None:
        norms = 2 * 4 * h
        adapters = 4 * options.lora_rank * c + (3 * c * h + c * shape.q_dim if c < 4 else 4 * h)
        return norms + adapters + attention + mask + c * 3 * shape.intermediate + 2 * 4
    if _autocast(options):
        norms = 2 * (4 * h + 4 * h) + 5 * c * h
    elif c == 4:
        norms = 2 * 3 * 4 * h
    else:
        norms = 2 * (4 * h + 2 * c * h)
    mlp = c * 4 * shape.intermediate
    return norms + attention + mask + mlp + 2 * 4


def head_bytes(shape: ModelShape, options: MemoryOptions, *, backward: bool) -> float:
    """The LM head's peak (``policies.logprobs``: the head runs chunk by chunk and each chunk is recomputed in the
    backward, so only one chunk's float32 [C, V] tensors are ever alive): :data:`HEAD_BACKWARD_CHUNKS` of them in
    the backward (:data:`HEAD_FORWARD_CHUNKS` in a no-gradient pass), plus, in the backward, the chunk's weight
    gradient [V, H] before it is added to the accumulated one (in the compute dtype, and cast to float32 under
    autocast)."""
    chunk = min(options.head_chunk_tokens, options.micro_batch_tokens)
    per_chunk = 4 * chunk * shape.vocab
    if not backward:
        return HEAD_FORWARD_CHUNKS * per_chunk
    trained = options.lora_rank is None
    weight_grad = shape.vocab * shape.hidden * (_compute_bytes(options) + 4 * _autocast(options)) * trained
    return HEAD_BACKWARD_CHUNKS * per_chunk + weight_grad


def activation_bytes(shape: ModelShape, options: MemoryOptions) -> float:
    """Peak bytes of one micro-batch's forward and backward (N = ``micro_batch_tokens``), besides the weights.
    Always: the final norm's float32 input, normalized and weighted outputs and the hidden states gathered for
    the scored positions (4 x hidden floats per token; every token counted as scored) and the dense tree mask
    itself (one byte per pair, N x ``sequence_tokens``; sdpa only). Then:

    - without checkpointing, the backward starts with every layer's :func:`layer_activation_bytes` x N alive,
      and the LM head's backward (:func:`head_bytes`) runs first, on top of them;
    - with activation checkpointing (each decoder layer recomputed in its backward, non-reentrant), the forward
      keeps each layer's input (the residual stream: float32 unless pure bf16); the backward first runs the LM
      head's, then one layer at a time: its recomputed activations and the gradients in flight through it
      (:data:`LAYER_BACKWARD_EXTRA` of them more). These two never overlap: the larger counts.
    """
    n = options.micro_batch_tokens
    layer = n * layer_activation_bytes(shape, options)
    head = head_bytes(shape, options, backward=True)
    final = n * 4 * 4 * shape.hidden
    mask = n * (options.sequence_tokens or n) if options.learner_attention == "sdpa" else 0
    if options.gradient_checkpointing:
        residual = 4 if options.dtype == "float32" or _autocast(options) else 2
        layer_inputs = shape.layers * n * residual * shape.hidden
        return layer_inputs + final + mask + max(head, (1 + LAYER_BACKWARD_EXTRA) * layer)
    return shape.layers * layer + final + mask + head


def no_grad_activation_bytes(shape: ModelShape, options: MemoryOptions) -> float:
    """Peak bytes of a no-gradient pass (old and reference log-probs): the residual stream, one layer's
    intermediates at a time, the hidden states for the head and one head chunk."""
    n = options.micro_batch_tokens
    mask = n * (options.sequence_tokens or n) if options.learner_attention == "sdpa" else 0
    return n * 4 * 4 * shape.hidden + n * layer_activation_bytes(shape, options) + mask + head_bytes(
        shape, options, backward=False)


def fsdp_gathered_bytes(shape: ModelShape, options: MemoryOptions) -> float:
    """The parameters FSDP holds gathered during a pass, in the compute dtype (its mixed precision gathers them so):
    two decoder layers (the one running and the one prefetched) and the root unit (embeddings and LM head), which
    stays gathered around the whole pass (``policies.fsdp.ShardedRoot``)."""
    return _compute_bytes(options) * (2 * shape.layer_parameters + shape.embedding_parameters)


def fsdp_unsharded_gradient_bytes(shape: ModelShape, options: MemoryOptions) -> float:
    """The full-size gradients FSDP holds in a backward before their reduce-scatter, in the compute dtype: the root
    unit's, from the LM head's backward (the first) to the end of the pass, and one layer's; plus that layer's cast
    to float32 for the reduction (``reduce_dtype``) when the compute dtype is narrower. Every micro-batch's are
    reduce-scattered: nothing full-size outlives a backward."""
    c = _compute_bytes(options)
    return c * (shape.embedding_parameters + shape.layer_parameters) + (4 * shape.layer_parameters if c < 4 else 0)


def sync_bytes(shape: ModelShape, options: MemoryOptions) -> float:
    """Bytes of one weight sync (``policies.weight_sync``: every engine tensor once, in the compute dtype), all of
    it in Ray's object store at once when remote env runners fetch it."""
    return _compute_bytes(options) * shape.parameters


def kv_cache_bytes(shape: ModelShape, options: MemoryOptions, rows: int) -> float:
    """The keys and values of ``rows`` branches, each ``rollout_context`` tokens, in the compute dtype."""
    return 2 * shape.layers * shape.kv_dim * _compute_bytes(options) * rows * options.rollout_context


def engine_weights_and_kv_bytes(shape: ModelShape, options: MemoryOptions) -> float:
    """An engine's weights in the compute dtype and the KV cache of the branches it decodes at once: the HF engine's
    memory, and the least of a vLLM engine's share that runs the rollout without pre-empting a branch."""
    rows = options.rollout_sequences if options.generator == "vllm" else min(options.rollout_sequences, HF_MAX_ROWS)
    return _compute_bytes(options) * shape.parameters + kv_cache_bytes(shape, options, rows)


def rollout_engine_bytes(shape: ModelShape, options: MemoryOptions) -> float:
    """A colocated engine's memory on the learner's GPU (0 when not colocated): see the module docstring."""
    if not options.colocated:
        return 0.0
    if options.generator == "vllm":
        return options.vllm_gpu_memory_utilization * options.gpu_memory_gib * GIB
    return engine_weights_and_kv_bytes(shape, options)


def startup_parts(shape: ModelShape, options: MemoryOptions, *, host_is_device: bool = False) -> dict[str, float]:
    """Bytes per GPU at the peak of a learner's build, before its first update, by part (:data:`PARTS`; no
    gradients, optimizer state or activations yet; the engine and the overhead are the plan's):

    - one learner or DDP: RLlib moves the whole module to the device (weights as loaded: the trained ones in their
      dtype, a LoRA base in the compute dtype and its float32 adapters), then the KL reference is copied there in
      the compute dtype (on the host when offloaded; none with LoRA);
    - FSDP over K learners: the module stays on the host where it is built; ``fully_shard`` moves each unit to the
      device whole while its shard is cut (the largest unit: the root's embeddings and untied LM head, or one
      decoder layer), beside the shards cut so far (at most the weights / K); then the reference's shards (its
      bytes / K, on the host when offloaded) are copied from the policy's, the unit gone.

    ``host_is_device``: a CPU run, whose device is the host: the whole module as built counts (and the first unit's
    shard while it is cut: the units are then halved one by one), and so does an offloaded reference."""
    k, c = options.learners, _compute_bytes(options)
    master = 2 if options.pure_bf16 else 4
    lora = options.lora_rank is not None
    loaded = c if lora else master  # the bytes of a parameter as the module is built (a LoRA base: compute dtype)
    weights = loaded * shape.parameters + (4 * shape.lora_parameters(options.lora_rank) if lora else 0)
    reference = c * shape.parameters if options.reference and not lora else 0.0
    if options.reference_offload and not host_is_device:
        reference = 0.0
    if options.sharding == "ddp":
        learner = {"weights": weights, "reference": reference}
    else:
        if host_is_device:  # the whole module, and the first unit's shard beside it (a layer: the root is cut last)
            cutting = {"weights": weights + loaded * shape.layer_parameters / k}
        else:
            cutting = {"weights": weights / k + loaded * max(shape.embedding_parameters, shape.layer_parameters)}
        learner = max(cutting, {"weights": weights / k, "reference": reference / k}, key=lambda p: sum(p.values()))
    return {part: learner.get(part, 0.0) for part in PARTS if part not in ("rollout_engine", "overhead")}


def plan_memory(shape: ModelShape, options: MemoryOptions) -> MemoryPlan:
    """The memory plan of training ``shape`` as ``options`` say (see the module docstring for the model)."""
    k = options.learners if options.sharding == "fsdp" else 1
    c = _compute_bytes(options)
    p = shape.parameters
    if options.lora_rank is not None:
        trained, master = shape.lora_parameters(options.lora_rank), 4
        weights, copies = c * p + 4 * trained, 0.0
    else:
        trained, master = p, 2 if options.pure_bf16 else 4
        weights, copies = master * p, 2 * p if _mixed(options) and options.sharding == "ddp" else 0.0
    gradients = master * trained
    if options.sharding == "ddp" and options.learners > 1:
        gradients *= 2  # the DDP reducer's buckets
    optimizer = 2 * master * trained
    step_temporary = master * trained / k  # foreach AdamW: the square roots of all second moments at once
    reference = c * p if options.reference and options.lora_rank is None else 0.0
    no_grad_reference = reference  # an offloaded reference is brought in for the no-gradient passes
    gathered = in_flight = 0.0  # FSDP's parameters gathered for a pass; its full-size gradients before reduction
    if options.sharding == "fsdp":
        weights, gathered = weights / k, fsdp_gathered_bytes(shape, options)
        gradients, optimizer, reference = gradients / k, optimizer / k, reference / k
        if options.lora_rank is None:  # a LoRA base has no gradients; the adapters' are negligible
            in_flight = fsdp_unsharded_gradient_bytes(shape, options)
        # the reference's passes follow the policy's, whose units are resharded by then: their gathers take turns
        # (counted in the weights); an offloaded reference's shards stay on the host, brought in unit by unit
        no_grad_reference = 0.0 if options.reference_offload else reference
    resident_reference = 0.0 if options.reference_offload else reference
    engine = rollout_engine_bytes(shape, options)
    engine_in_update = 0.0 if options.vllm_sleep and options.generator == "vllm" else engine
    overhead = options.overhead_gib * GIB
    phases = {
        "update": {"weights": weights + copies + gathered, "gradients": gradients + in_flight, "optimizer": optimizer,
                   "reference": resident_reference, "activations": activation_bytes(shape, options),
                   "rollout_engine": engine_in_update, "overhead": overhead},
        "optimizer step": {"weights": weights, "gradients": gradients, "optimizer": optimizer + step_temporary,
                           "reference": resident_reference, "activations": 0.0, "rollout_engine": engine_in_update,
                           "overhead": overhead},
        "no-grad passes": {"weights": weights + copies + gathered, "gradients": 0.0, "optimizer": optimizer,
                           "reference": no_grad_reference, "activations": no_grad_activation_bytes(shape, options),
                           "rollout_engine": engine_in_update, "overhead": overhead},
    }
    phases["startup"] = {**startup_parts(shape, options), "rollout_engine": engine_in_update, "overhead": overhead}
    if engine != engine_in_update:
        phases["rollout"] = {"weights": weights, "gradients": 0.0, "optimizer": optimizer,
                             "reference": resident_reference, "activations": 0.0, "rollout_engine": engine,
                             "overhead": overhead}
    totals = {name: sum(parts.values()) / GIB for name, parts in phases.items()}
    peak = max(totals, key=totals.get)
    parts = {name: phases[peak][name] / GIB for name in PARTS}
    total = totals[peak]
    fits = None if options.gpu_memory_gib is None else total <= USABLE_SHARE * options.gpu_memory_gib
    return MemoryPlan(model=shape.name, parameters=p, parts=parts, per_gpu_gib=total, phase=peak, phases=totals,
                      fits=fits, gpu_memory_gib=options.gpu_memory_gib, options=options,
                      shape=shape)
