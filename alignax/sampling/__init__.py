"""On-device generation: prefill + ``jax.lax.while_loop`` decode over a KV cache in one jit.

``generate(graphdef, state, prompt_tokens, prompt_mask, rng, *, config)`` returns a
:class:`SamplingOutput`; see sampler.py for the log-prob conventions and the row layout.
"""

from alignax.sampling.distribution import sampling_logprobs
from alignax.sampling.sampler import SamplingConfig, SamplingOutput, generate, left_pad

__all__ = ["SamplingConfig", "SamplingOutput", "generate", "left_pad", "sampling_logprobs"]
