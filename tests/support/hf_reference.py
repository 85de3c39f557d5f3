"""transformers' PyTorch models of the tiny family configs (tests/support/model_families.py),
every parameter perturbed off its init (norm weights off 0/1, biases off 0): the reference
the model tests load into alignax. torch is imported when a model is built, so a test module
can ``pytest.importorskip("torch")`` before calling in."""

from __future__ import annotations

import numpy as np

from tests.support.model_families import CONFIGS, HF_CLASS_NAMES, MOE_CONFIGS


def hf_model(family: str, *, cls=None, seed: int = 0, scale: float = 0.1, **overrides):
    """``(config dict, transformers model in eval mode)``: ``CONFIGS[family]`` (or
    ``MOE_CONFIGS[family]``) with ``overrides``,
    each parameter plus ``scale`` times a standard normal drawn from ``seed``."""
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASS_NAMES[family])
    cfg = dict({**CONFIGS, **MOE_CONFIGS}[family], **overrides)
    torch.manual_seed(seed)
    model = (cls or model_cls)(config_cls(**{k: v for k, v in cfg.items() if k != "model_type"}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return cfg, model.eval()


def state_dict(model) -> dict[str, np.ndarray]:
    """The model's tensors as NumPy arrays (what ``from_hf_state_dict`` takes)."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def perturbed_families(families, *, scale: float = 0.1) -> dict:
    """``family -> (config dict, transformers model, state dict)``, family ``i`` seeded ``i``."""
    out = {}
    for i, family in enumerate(families):
        cfg, model = hf_model(family, seed=i, scale=scale)
        out[family] = (cfg, model, state_dict(model))
    return out


def torch_logits(model, tokens, mask, positions) -> np.ndarray:
    """transformers' logits ``[B, T, V]`` with explicit mask and positions."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))
    return out.logits.numpy()
