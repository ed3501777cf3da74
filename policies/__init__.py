"""LLM policies: model loading, token-exact multi-turn generation with branching, the RLlib RLModule."""
