"""Offline training on fixed data: SFT, reward models, DPO family and KTO."""
