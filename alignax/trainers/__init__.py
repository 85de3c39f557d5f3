"""Trainers: the shared step and loop, and one module per algorithm family.

``alignax.trainers.run.train(config)`` runs SFT, reward-model and DPO-family recipes;
``alignax.trainers.online.train(config)`` runs PPO (``trainers.ppo``) and the GRPO family
(``trainers.grpo``) on the shared online trainer (``trainers.online``).
"""
