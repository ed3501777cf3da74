"""Metric keys of Tree-GRPO (one place, so the runner, the learner, run.py and the tests agree)."""

# per iteration, from the env runners
REWARD = "reward_mean"
EM = "em_mean"
TOKENS_GENERATED = "tokens_generated"
TOKENS_PREFILLED = "tokens_prefilled"
LLM_CALLS = "llm_calls"
TOOL_CALLS = "tool_calls"
LEAVES = "leaves"
TREES = "trees"
SAMPLE_TIME_S = "sample_time_s"
GENERATION_TIME_S = "generation_time_s"  # inside the step generator
ENV_TIME_S = "env_time_s"  # inside env.step (retrieval included) and snapshot restores
BUDGET_ESTIMATE = "budget_chains_estimate"  # the paper's M (1 + L N / 2) full chains per prompt
BUDGET_MEASURED = "budget_chains_measured"  # generated tokens per prompt / tokens of one initial chain

# per update, from the learner
POLICY_LOSS = "policy_loss"
KL = "kl"
ENTROPY = "entropy"
CLIP_FRACTION = "clip_fraction"
DUAL_CLIP_FRACTION = "dual_clip_fraction"
RATIO_MEAN, RATIO_MAX, RATIO_MIN = "ratio_mean", "ratio_max", "ratio_min"
GRAD_NORM = "grad_norm"
LEARNING_RATE = "learning_rate"
SAMPLER_LOGPROB_GAP = "sampler_logprob_gap"  # |sampling log-prob - recomputed log-prob|: token exactness
TRAINED_TOKENS = "trained_tokens"
