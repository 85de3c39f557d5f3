"""Online RL: rollout → reward → advantage → update, for the GRPO and PPO families."""
