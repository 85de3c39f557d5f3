"""Trainers: the shared step and loop, and one module per algorithm family.

``alignax.trainers.run.train(config)`` runs SFT, reward-model and DPO-family recipes;
``alignax.trainers.online`` runs PPO and the GRPO family.
"""
