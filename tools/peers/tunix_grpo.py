"""Time one Tunix GRPO step (generation + update) on CPU; print one JSON line.

Run with the bench venv (Tunix 0.1.7 lives there, not in .venv):

    .venv-bench/bin/python tools/peers/tunix_grpo.py --model-config tiny \
        --batch 8 --seq 128 --steps 3 --warmup 1

``--batch`` prompts per step, each sampled ``--num-generations`` times (G), so a step
handles batch x G sequences of ``--seq`` = ``--prompt-len`` + generated tokens. Prompts
are random token ids of exactly ``--prompt-len`` tokens (BOS included) written as text
for a whitespace-integer tokenizer, so no tokenizer files are needed and lengths are
exact. Completions have exactly ``seq - prompt_len`` tokens: EOS is disabled unless
``--eos-stop`` (a random model samples EOS now and then, which would only shorten
completion masks, not the work: Tunix's decode loop runs until every row is done).

The run is Tunix's own loop, ``GRPOLearner.train`` (tunix/rl/grpo/grpo_learner.py and
rl_learner.py) with the vanilla rollout engine (Tunix's jitted prefill + while_loop
decode with a KV cache), actor, rollout and reference colocated on the one CPU device
(actor and rollout share weights, so there is no weight sync). One global step is:
  rollout  ``RLCluster.generate``: sample G completions per prompt;
  ref      ``RLCluster.get_ref_per_token_logps``: reference forward on prompt+completion;
  (reward function, group advantages, metric buffering: host work)
  update   ``RLCluster.update_actor``: policy forward/backward with the GRPO loss and
           one optax update (num_iterations=1, so old log-probs = stop_gradient(new)).
The script wraps those three calls and ``_run_global_step`` with timers (blocking on
their outputs); it does not change what they do. Tunix 0.1.7 exposes the same split
through its perf tracer, but that path needs an export function per span; wrapping
is simpler and measures the same calls.

``--lora-rank R`` trains a qwix LoRA actor instead (``qwix.apply_lora_to_model`` on the
seven projections, as Tunix's grpo_main does with a ``lora_config``; ``--lora-qtype nf4``
for QLoRA); the reference is the adapter-free base, a separate copy (qwix clones the model
it adapts). ``--memory`` reports the policy's, optimizer's and reference's resident bytes
(the update runs inside RLCluster, so no compiled memory analysis here).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _tunix_common as common  # noqa: E402

common.offline()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default=None, help="preset (tiny, smollm2-135m) or HF config.json path")
    p.add_argument("--weights-dir", default=None, help="local HF safetensors directory to load (no hub access)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one HF config field, e.g. --set num_hidden_layers=4")
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--num-generations", type=int, default=2, help="G completions per prompt (Tunix default 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (prompt + generated)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens incl. BOS (default seq // 2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first one compiles)")
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (Tunix default 0.04)")
    p.add_argument("--epsilon", type=float, default=0.2, help="PPO clip (Tunix default 0.2)")
    p.add_argument("--kl-mode", default="kl", choices=("kl", "mse_kl", "low_var_kl"),
                   help="Tunix GRPOConfig.kl_loss_mode (default 'kl' = k1 estimator)")
    p.add_argument("--loss-agg", default="sequence-mean-token-mean",
                   help="Tunix GRPOConfig.loss_agg_mode (default sequence-mean-token-mean)")
    p.add_argument("--temperature", type=float, default=0.9, help="RolloutConfig default 0.9")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="RolloutConfig default 1.0 (Tunix then runs its top-p path: a full vocab sort per token); "
                        "negative = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--kv-cache-size", type=int, default=None,
                   help="KV cache length (default seq: the decode attends over the whole cache; Tunix default 1024)")
    p.add_argument("--eos-stop", action="store_true",
                   help="let sampling stop at the tokenizer's EOS (Tunix default); off: EOS is disabled so every "
                        "completion has exactly seq - prompt_len tokens and work per step is fixed")
    p.add_argument("--lr", type=float, default=1e-6, help="optax.adamw learning rate")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
    p.add_argument("--remat", default="none", choices=("none", "block", "decoder"))
    p.add_argument("--seed", type=int, default=0)
    common.add_lora_args(p)
    args = p.parse_args(argv)
    if args.prompt_len is None:
        args.prompt_len = args.seq // 2
    if not 1 < args.prompt_len < args.seq:
        p.error(f"--prompt-len must be in [2, seq-1] = [2, {args.seq - 1}]; got {args.prompt_len}")
    if args.num_generations < 2:
        p.error(f"--num-generations must be >= 2 (group advantages need a group); got {args.num_generations}")
    if args.batch < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch and --steps must be >= 1, --warmup >= 0")
    if args.kv_cache_size is None:
        args.kv_cache_size = args.seq
    if args.kv_cache_size < args.seq:
        p.error(f"--kv-cache-size must be >= seq ({args.seq}); got {args.kv_cache_size}")
    return args


def make_prompts(n_steps, *, batch, prompt_len, vocab, seed):
    """Per step a dict {'prompts': array of `batch` strings of prompt_len-1 ids (+BOS)}."""
    import numpy as np

    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(n_steps):
        ids = rng.integers(common.FIRST_FREE_ID, vocab, size=(batch, prompt_len - 1))
        steps.append({"prompts": np.array([" ".join(map(str, row)) for row in ids])})
    return steps


def parity_reward(prompts, completions, **_):
    """Cheap deterministic reward: share of even token ids in the completion."""
    out = []
    for text in completions:
        ids = [int(t) for t in text.split()]
        out.append(sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    args.warmup, warmup_notes = common.min_warmup(args.warmup, args.weights_dir)
    common.reserve_stdout()
    common.quiet_logs()

    import jax
    import optax
    from jax.interpreters import pxla
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    clock = common.CompileClock()
    spec = common.load_model_spec(args.model_config, args.weights_dir, args.overrides)
    t0 = time.perf_counter()
    policy, init_note = common.build_llama(
        spec, weights_dir=args.weights_dir, seed=args.seed, dtype=args.dtype, remat=args.remat
    )
    policy, reference, lora = common.policy_and_reference(policy, args)
    n_params = common.count_params(reference)

    gen_len = args.seq - args.prompt_len
    total_steps = args.warmup + args.steps
    # One CPU device: the empty ambient mesh, as Tunix's own CPU tests use; actor,
    # rollout and reference are colocated, so the rollout shares the actor's weights.
    with warnings.catch_warnings():  # Tunix itself reads the same deprecated global
        warnings.simplefilter("ignore", DeprecationWarning)
        mesh = pxla.thread_resources.env.physical_mesh
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=gen_len,
        max_prompt_length=args.prompt_len,
        kv_cache_size=args.kv_cache_size,
        temperature=args.temperature,
        top_p=None if args.top_p is not None and args.top_p < 0 else args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        # [-1] is never sampled: fixed-length completions (the decode loop only stops
        # early when every row is done, so compute is the same either way; lengths and
        # loss masks then are too).
        eos_tokens=None if args.eos_stop else [-1],
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(args.lr),
            eval_every_n_steps=10**9,
            max_steps=total_steps,
            pbar_description=None,
        ),
        rollout_config=rollout_config,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=policy,
        reference=reference,
        tokenizer=common.IntTokenizer(),
        cluster_config=cluster_config,
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=args.num_generations,
        num_iterations=1,
        beta=args.beta,
        epsilon=args.epsilon,
        kl_loss_mode=args.kl_mode,
        loss_agg_mode=args.loss_agg,
    )
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[parity_reward])
    build_s = time.perf_counter() - t0

    # ---- timers around the calls Tunix's loop makes (behaviour unchanged)
    calls = defaultdict(list)
    completion_lengths = []

    def timed(name, fn, *, block=False, after=None):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            if block:
                jax.block_until_ready(out)
            calls[name].append(time.perf_counter() - start)
            if after is not None:
                after(out)
            return out

        return wrapper

    cluster.generate = timed(
        "rollout", cluster.generate, after=lambda out: completion_lengths.append([len(t) for t in out.tokens])
    )
    cluster.get_ref_per_token_logps = timed("ref", cluster.get_ref_per_token_logps, block=True)
    cluster.update_actor = timed("update", cluster.update_actor)
    learner._run_global_step = timed("step", learner._run_global_step)

    compile_marks = []
    original_step = learner._run_global_step

    def step_with_compile_marks(*a, **k):
        compile_marks.append(clock.snapshot())
        out = original_step(*a, **k)
        compile_marks.append(clock.snapshot())
        return out

    learner._run_global_step = step_with_compile_marks

    data = make_prompts(
        total_steps, batch=args.batch, prompt_len=args.prompt_len, vocab=int(spec["vocab_size"]), seed=args.seed + 1
    )
    start = time.perf_counter()
    learner.train(data)
    train_wall_s = time.perf_counter() - start

    n_steps_run = len(calls["step"])
    if n_steps_run != total_steps:
        raise RuntimeError(f"Tunix ran {n_steps_run} global steps; expected warmup+steps = {total_steps}")
    timed_slice = slice(args.warmup, total_steps)
    step_times = calls["step"][timed_slice]
    rollout_times = calls["rollout"][timed_slice]
    ref_times = calls["ref"][timed_slice]
    update_times = calls["update"][timed_slice]
    other_times = [s - r - f - u for s, r, f, u in zip(step_times, rollout_times, ref_times, update_times)]

    # compile events inside the warmup steps and inside the timed steps
    warm_compile = sum(compile_marks[2 * i + 1][0] - compile_marks[2 * i][0] for i in range(args.warmup))
    warm_backend = sum(compile_marks[2 * i + 1][1] - compile_marks[2 * i][1] for i in range(args.warmup))
    timed_compile = sum(
        compile_marks[2 * i + 1][0] - compile_marks[2 * i][0] for i in range(args.warmup, total_steps)
    )
    gen_lens = [x for step in completion_lengths[args.warmup:] for x in step]

    notes = [
        "Tunix's own GRPOLearner.train loop with the vanilla rollout; per-phase times come "
        "from timers wrapped around RLCluster.generate / get_ref_per_token_logps / "
        "update_actor and RLLearner._run_global_step (step = whole global step).",
        "other = step - rollout - ref - update: reward fn, advantages, host padding, queues, metrics.",
        f"model: {init_note}.",
        "sampling: " + ("greedy" if rollout_config.top_p is None else
                        f"top_p={rollout_config.top_p} (Tunix sorts the vocab each decode step)")
        + f", temperature {args.temperature}; training log-probs use logits / temperature as Tunix does.",
    ]
    notes.extend(warmup_notes)
    notes.extend(common.model_caveats(spec))
    if args.warmup == 0:
        notes.append("warmup=0: the first timed step includes compilation.")
    if timed_compile > 0.5:
        notes.append(f"compiled {timed_compile:.2f}s during timed steps (shape changes).")

    median = common.median
    result = {
        "peer": "tunix",
        **common.versions(),
        "task": "grpo",
        "model": common.shape_summary(spec) | {"n_params": n_params},
        "batch": args.batch,
        "seq": args.seq,
        "prompt_len": args.prompt_len,
        "gen_len": gen_len,
        "num_generations": args.num_generations,
        "sequences_per_step": args.batch * args.num_generations,
        "dtype": args.dtype,
        "remat": args.remat,
        "hyper": {
            "algo": "grpo (policy_loss_fn grpo, advantage_estimator grpo: (r - mean) / (std_ddof1 + 1e-6))",
            "num_generations": args.num_generations,
            "num_iterations": 1,
            "beta": args.beta,
            "kl_loss_mode": args.kl_mode,
            "epsilon": args.epsilon,
            "loss_agg_mode": args.loss_agg,
            "temperature": args.temperature,
            "top_p": rollout_config.top_p,
            "top_k": args.top_k,
            "max_prompt_length": args.prompt_len,
            "max_tokens_to_generate": gen_len,
            "total_sampling_steps": args.prompt_len + gen_len,
            "kv_cache_size": args.kv_cache_size,
            "eos_stop": args.eos_stop,
            "micro_batching": "none (mini_batch = train_micro_batch = rollout/logps micro batch = full batch)",
            "optimizer": f"optax.adamw(learning_rate={args.lr}) (defaults b1=0.9 b2=0.999 eps=1e-8 wd=1e-4)",
            "reward": "share of even token ids in the completion (host Python)",
        },
        "warmup": args.warmup,
        "steps": args.steps,
        "step_time_s_median": median(step_times),
        "step_times_s": step_times,
        "generation_time_s_median": median(rollout_times),
        "generation_times_s": rollout_times,
        "ref_logps_time_s_median": median(ref_times),
        "update_time_s_median": median(update_times),
        "update_times_s": update_times,
        "other_time_s_median": median(other_times),
        "first_step_time_s": calls["step"][0],
        "compile_time_s": warm_compile,
        "xla_compile_time_s": warm_backend,
        "compile_time_timed_steps_s": timed_compile,
        "build_time_s": build_s,
        "train_wall_time_s": train_wall_s,
        "generated_tokens_per_s": (args.batch * args.num_generations * gen_len) / median(rollout_times),
        "completion_length_mean": (sum(gen_lens) / len(gen_lens)) if gen_lens else None,
        "devices": [str(d) for d in jax.devices()],
        "lora": lora,
        "memory": {"policy_state_bytes": common.state_bytes(policy),
                   "reference_state_bytes": common.state_bytes(reference)} if args.memory else None,
        "notes": " ".join(notes),
    }
    common.emit(result)


if __name__ == "__main__":
    main()
