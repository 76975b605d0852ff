"""The GSPO loop: rollout -> rewards -> advantages -> update -> weight sync -> log -> checkpoint."""
