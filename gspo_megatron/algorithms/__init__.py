"""GSPO / GSPO-token / GRPO: log-probs, advantages, policy losses, metrics (pure tensor code)."""
