"""Metric keys of Tree-GRPO (one place, so the runner, the learner, run.py and the tests agree)."""

# per iteration, from the env runners
REWARD = "reward_mean"
EM = "em_mean"
TOKENS_GENERATED = "tokens_generated"
TOKENS_PREFILLED = "tokens_prefilled"  # computed without a cache (HF: a node's KV cache; vLLM: its prefix cache)
LLM_CALLS = "llm_calls"
FORWARD_PASSES = "forward_passes"  # of the model in the step generator (engine iterations)
TOKENS_PER_FORWARD_PASS = "tokens_per_forward_pass"  # tokens_generated / forward_passes: how full the batches ran
KV_PEAK_MIB = "kv_peak_mib"  # the HF engine's keys and values at their peak in one rollout (largest runner)
TOOL_CALLS = "tool_calls"
RETRIEVAL_RETRIES = "retrieval_retries"  # failed requests to a retrieval server that were retried
LEAVES = "leaves"
TREES = "trees"
SAMPLE_TIME_S = "sample_time_s"
GENERATION_TIME_S = "generation_time_s"  # inside the step generator
ENV_TIME_S = "env_time_s"  # inside env.step (retrieval included) and snapshot restores
BUDGET_ESTIMATE = "budget_chains_estimate"  # the paper's M (1 + L N / 2) full chains per prompt
BUDGET_MEASURED = "budget_chains_measured"  # generated tokens per prompt / tokens of one initial chain

# per iteration, from the algorithm
ENV_RUNNER_RESTARTS = "env_runner_restarts"  # failed env runners brought back (restarted, weights synced)
SAMPLED_BY = "sampled_by"  # the env runners that returned samples (worker indices; 0: the local runner)

# per update, from the learner
POLICY_LOSS = "policy_loss"
KL = "kl"
ENTROPY = "entropy"
CLIP_FRACTION = "clip_fraction"
DUAL_CLIP_FRACTION = "dual_clip_fraction"
RATIO_MEAN, RATIO_MAX, RATIO_MIN = "ratio_mean", "ratio_max", "ratio_min"
GRAD_NORM = "grad_norm"
NONFINITE_GRAD_SHARE = "nonfinite_grad_share"  # optimizer steps whose gradient norm was NaN / inf (skipped by default)
LEARNING_RATE = "learning_rate"
SAMPLER_LOGPROB_GAP = "sampler_logprob_gap"  # |sampling log-prob - recomputed log-prob|: token exactness
TRAINED_TOKENS = "trained_tokens"
OPTIMIZER_STEPS = "optimizer_steps"  # taken so far (the schedule position)
OLD_LOGPROBS_RECOMPUTED = "old_logprobs_recomputed"  # 1: the learner's (one extra forward pass), 0: the sampler's
# the sampler's log-probs against the learner's (before the update): ratio r = exp(learner - sampler)
SAMPLER_RATIO_MEAN, SAMPLER_RATIO_P99 = "sampler_ratio_mean", "sampler_ratio_p99"
SAMPLER_RATIO_OUTSIDE = "sampler_ratio_outside"  # share of generated tokens with r outside [0.9, 1.1]
# shared-prefix training: unique tokens of the batch's micro-batch tries / the rows' tokens (the reuse the trees
# offer), and tokens the decoder forwarded / the rows' tokens (the work done; shared ancestors repeat per segment)
UNIQUE_TOKEN_SHARE, FORWARDED_TOKEN_SHARE = "unique_token_share", "forwarded_token_share"
# the update's peak memory: CUDA, the learner device's tensors (max_memory_allocated); CPU, the process's peak
# resident set (VmHWM, reset at the update's start; see policies.memory)
LEARNER_PEAK_MEMORY_GIB = "learner_peak_memory_gib"
TIS_WEIGHT_MEAN = "tis_weight_mean"  # mean truncated importance weight (1 when the sampler's are the old ones)

# per iteration, from the algorithm
PROMPTS = "prompts"
ITERATION_TIME_S = "iteration_time_s"  # sampling + update + sync (evaluation not included)
UPDATE_TIME_S = "update_time_s"  # the learner group's update, as the driver waits for it
SYNC_TIME_S = "sync_time_s"  # the weight sync to the env runners
DEV_PREFIX = "dev_"  # metrics.jsonl: the greedy evaluation's columns (dev_em, dev_f1, ...) on evaluating iterations
