"""Reinforcement-learning post-training: algorithms, rollout, rewards and the loop."""
