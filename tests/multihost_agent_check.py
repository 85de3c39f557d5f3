"""One process of the multi-process rollout check: multi-turn trajectories of this
process's rows of one global prompt batch. Prints one JSON line.

    python tests/multihost_agent_check.py PROCESS_ID NUM_PROCESSES PORT MODEL_DIR

Run by tests/test_multihost_agents.py with ``--xla_force_host_platform_device_count`` set,
once per process (``NUM_PROCESSES`` 1 runs without ``jax.distributed``). The rollout is
the online trainer's own (its :class:`alignax.envs.rollout.EnvSampler`, its data
iterator: this process reads its block of the global batch), with
:class:`tests.support.toy_agent.ChattyEnv` and stop words that end turns early, so rows see
observations and finish at different turns.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax

from alignax.parallel import multihost
from alignax.trainers.api import build_trainer
from tests.fake_devices import leave_processes
from tests.support.toy_agent import agent_config, agent_tokenizer, lookup_records


def main() -> int:
    process_id, num_processes, port, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    distributed = ({"coordinator": f"127.0.0.1:{port}", "num_processes": num_processes, "process_id": process_id}
                   if num_processes > 1 else {})
    tok = agent_tokenizer()
    stops = [tok.convert_tokens_to_ids(w) for w in ("<|im_end|>", "yes", "no", "ok", "sure", "hi", "is")]
    with tempfile.TemporaryDirectory() as tmp:
        config = agent_config(tmp, model_dir, steps=1, mesh={"shape": [1, -1, 1]}, distributed=distributed,
                              env={"name": "tests.support.toy_agent:ChattyEnv"},
                              rollout={"stop_token_ids": stops}, data={"eval_fraction": 0.0},
                              logging={"console": False, "tensorboard": False})
        multihost.initialize(config.distributed)
        trainer = build_trainer(config, records=lookup_records(16))
        batch = next(trainer.data.iterator("train"))
        actors = trainer.actors
        groups, _, _ = actors.sampler.sample(actors.sampling_state(actors.initial_params), batch, jax.random.key(3))
    print(json.dumps({
        "process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
        "prompts": [r["prompt"] for r in groups.references[:: config.rollout.num_samples]],
        "tokens": groups.tokens.tolist(), "response_mask": groups.response_mask.tolist(),
        "action_mask": groups.action_mask.tolist(), "sampler_logps": groups.sampler_logps.tolist(),
        "rewards": groups.rewards.tolist(), "trajectory": {k: v.tolist() for k, v in groups.trajectory.items()},
    }), flush=True)
    return 0


if __name__ == "__main__":
    if main() == 0:
        leave_processes()
    sys.exit(1)
