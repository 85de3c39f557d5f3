"""Time one Tunix DPO training step on CPU; print one JSON line.

Run with the bench venv (Tunix 0.1.7 lives there, not in .venv):

    .venv-bench/bin/python tools/peers/tunix_dpo.py --model-config tiny \
        --batch 8 --seq 128 --steps 5 --warmup 1

``--model-config`` is a preset (``tiny``, ``smollm2-135m``) or a Hugging Face
``config.json`` path; ``--weights-dir`` loads a local HF safetensors directory instead
of a random init. Shapes: ``--batch`` preference pairs, each sequence ``--seq`` tokens =
``--prompt-len`` prompt tokens (left part, shared by chosen and rejected) + response
tokens. No padding: every token is real, so work is exactly B x 2 x T tokens.

What one step is, exactly as ``DPOTrainer.train`` does it (tunix/sft/dpo/dpo_trainer.py):
  1. ``DPOTrainer._prepare_inputs``: concatenate chosen and rejected into one batch of
     2B sequences, build causal mask/positions, and run the frozen reference model
     (``compute_logps``, one ``nnx.jit``) -> summed response log-probs per sequence;
  2. the jitted train step from ``jit_train_and_eval_step`` (``cache_nnx_graph=True``,
     as ``train()`` uses): policy forward on the 2B sequences, ``dpo_loss_fn`` (sigmoid
     loss, ``-log sigmoid(beta * delta)``, mean over pairs), backward, global grad
     norm, optax update.
Both parts are timed (blocking on their results), reported separately and summed.
``--lora-rank R`` trains Tunix's LoRA path instead: ``qwix.apply_lora_to_model`` with a
``qwix.LoraProvider`` on the seven projections (as tunix/cli/utils/model.py does; the
DPOTrainer then differentiates and optimises ``nnx.LoRAParam`` only), ``--lora-qtype nf4``
its QLoRA base. The reference is then the adapter-free base model: qwix clones the model it
adapts, so the policy's frozen base and the reference are two copies (Tunix's DPOTrainer
takes a separate ``ref_model``; ``None`` would mean no reference at all, not "adapters off").
``--memory`` compiles the train step ahead of time after the timed steps and reports its
``compiled.memory_analysis()`` (with JAX's persistent compilation cache in a temporary
directory, so that compile reads the run's executable back when the HLO is the same).
``--loop-check`` also runs ``trainer.train()`` itself over ``--steps`` more batches
and reports its wall time per step (includes Tunix's metric buffering and async
dispatch), as a cross-check that the component timing matches the real loop.
"""

from __future__ import annotations

import argparse
import sys
import time
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
    p.add_argument("--batch", type=int, default=8, help="preference pairs per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (prompt + response)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default seq // 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first one compiles)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-5, help="optax.adamw learning rate")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
    p.add_argument("--remat", default="none", choices=("none", "block", "decoder"))
    p.add_argument("--seed", type=int, default=0)
    common.add_lora_args(p)
    p.add_argument("--loop-check", action="store_true", help="also time trainer.train() over --steps batches")
    args = p.parse_args(argv)
    if args.prompt_len is None:
        args.prompt_len = args.seq // 2
    if not 0 < args.prompt_len < args.seq:
        p.error(f"--prompt-len must be in [1, seq-1] = [1, {args.seq - 1}]; got {args.prompt_len}")
    if args.batch < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch and --steps must be >= 1, --warmup >= 0")
    return args


def make_batches(n, *, batch, prompt_len, response_len, vocab, seed):
    """n TrainingInput batches of random token ids, masks all ones (no padding)."""
    import numpy as np
    from tunix.sft.dpo import dpo_trainer

    rng = np.random.default_rng(seed)

    def ids(length):
        return rng.integers(common.FIRST_FREE_ID, vocab, size=(batch, length), dtype=np.int32)

    ones_p = np.ones((batch, prompt_len), np.int32)
    ones_r = np.ones((batch, response_len), np.int32)
    return [
        dpo_trainer.TrainingInput(
            prompt_ids=ids(prompt_len),
            prompt_mask=ones_p,
            chosen_ids=ids(response_len),
            chosen_mask=ones_r,
            rejected_ids=ids(response_len),
            rejected_mask=ones_r,
        )
        for _ in range(n)
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    args.warmup, warmup_notes = common.min_warmup(args.warmup, args.weights_dir)
    common.reserve_stdout()
    common.quiet_logs()

    import jax
    import optax
    from flax import nnx
    from tunix.sft import sharding_utils
    from tunix.sft.dpo import dpo_trainer

    clock = common.CompileClock()
    cache_dir = None
    if args.memory:
        import tempfile

        cache_dir = tempfile.mkdtemp(prefix="tunix-dpo-cache-")
        common.persistent_cache(cache_dir)
    spec = common.load_model_spec(args.model_config, args.weights_dir, args.overrides)
    t0 = time.perf_counter()
    policy, init_note = common.build_llama(
        spec, weights_dir=args.weights_dir, seed=args.seed, dtype=args.dtype, remat=args.remat
    )
    policy, reference, lora = common.policy_and_reference(policy, args)
    build_s = time.perf_counter() - t0

    config = dpo_trainer.DPOTrainingConfig(
        algorithm="dpo",
        beta=args.beta,
        label_smoothing=args.label_smoothing,
        eval_every_n_steps=10**9,
        max_steps=args.steps,
        pbar_description=None,
    )
    trainer = dpo_trainer.DPOTrainer(
        model=policy,
        ref_model=reference,
        optimizer=optax.adamw(args.lr),
        training_config=config,
    )
    response_len = args.seq - args.prompt_len
    n_batches = args.warmup + args.steps * (2 if args.loop_check else 1)
    batches = make_batches(
        n_batches,
        batch=args.batch,
        prompt_len=args.prompt_len,
        response_len=response_len,
        vocab=int(spec["vocab_size"]),
        seed=args.seed + 1,
    )

    train_step, _ = trainer.jit_train_and_eval_step(skip_jit=False, cache_nnx_graph=True)

    def one_step(batch):
        start = time.perf_counter()
        example = trainer._prepare_inputs(batch)
        example = sharding_utils.shard_input(example, config.data_sharding_axis)
        jax.block_until_ready((example.ref_chosen_logps, example.ref_rejected_logps))
        mid = time.perf_counter()
        loss, aux, grad_norm = train_step(example)
        jax.block_until_ready((loss, aux, grad_norm, nnx.state(policy, nnx.Param)))
        end = time.perf_counter()
        return end - start, mid - start, end - mid, float(loss)

    compile_before, backend_before, _ = clock.snapshot()  # model build compiles excluded
    first_step_s = None
    losses = []
    for i in range(args.warmup):
        total, _, _, loss = one_step(batches[i])
        first_step_s = total if first_step_s is None else first_step_s
        losses.append(loss)
    compile_warm, backend_warm, n_compiles_warm = clock.snapshot()

    step_times, ref_times, train_times = [], [], []
    for i in range(args.warmup, args.warmup + args.steps):
        total, ref_s, train_s, loss = one_step(batches[i])
        step_times.append(total)
        ref_times.append(ref_s)
        train_times.append(train_s)
        losses.append(loss)
    compile_all, _, n_compiles_all = clock.snapshot()

    loop = None
    if args.loop_check:
        loop_batches = batches[args.warmup + args.steps:]
        start = time.perf_counter()
        trainer.train(loop_batches)
        loop_s = time.perf_counter() - start
        loop = {
            "loop_steps": len(loop_batches),
            "loop_time_s": loop_s,
            "loop_step_time_s_mean": loop_s / len(loop_batches),
            "loop_compile_s": clock.snapshot()[0] - compile_all,
        }

    memory = None
    if args.memory:
        example = sharding_utils.shard_input(trainer._prepare_inputs(batches[0]), config.data_sharding_axis)
        # The function jit_train_and_eval_step wraps, jitted as it jits it (donating the optimizer).
        jitted = nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",))
        before = clock.snapshot()
        memory = common.compiled_memory(jitted, trainer.model, trainer.optimizer, example)
        memory["aot_compile_s"] = clock.snapshot()[0] - before[0]
        memory["policy_state_bytes"] = common.state_bytes(policy)
        memory["optimizer_state_bytes"] = common.state_bytes(trainer.optimizer)
        memory["reference_state_bytes"] = common.state_bytes(reference)
        memory["what"] = ("peak_bytes: the jitted train step (policy fwd/bwd + update; its arguments are the policy "
                          "and the optimizer), arguments + outputs - donated + temporaries; the reference forward "
                          "is a separate jit, its weights (reference_state_bytes) stay resident besides")

    notes = [
        "step = DPOTrainer._prepare_inputs (reference forward, its own jit) + jitted "
        "train step (policy fwd/bwd + adamw update), both blocked; Tunix 0.1.7 has no "
        "built-in per-step timer, so the script times the same calls train() makes.",
        f"model: {init_note}.",
        "compile_time_s = JAX compile events (trace + lower + XLA compile) during warmup.",
    ]
    notes.extend(warmup_notes)
    notes.extend(common.model_caveats(spec))
    if args.warmup == 0:
        notes.append("warmup=0: the first timed step includes compilation.")
    if compile_all - compile_warm > 0.5:
        notes.append(
            f"recompiled during timed steps ({compile_all - compile_warm:.2f}s, "
            f"{n_compiles_all - n_compiles_warm} XLA compiles)."
        )

    result = {
        "peer": "tunix",
        **common.versions(),
        "task": "dpo",
        "model": common.shape_summary(spec) | {"n_params": common.count_params(reference if lora else policy)},
        "batch": args.batch,
        "seq": args.seq,
        "prompt_len": args.prompt_len,
        "response_len": response_len,
        "sequences_per_step": 2 * args.batch,
        "dtype": args.dtype,
        "remat": args.remat,
        "hyper": {
            "loss": "sigmoid",
            "beta": args.beta,
            "label_smoothing": args.label_smoothing,
            "logp_reduction": "sum over response tokens",
            "loss_reduction": "mean over pairs",
            "optimizer": f"optax.adamw(learning_rate={args.lr}) (defaults b1=0.9 b2=0.999 eps=1e-8 wd=1e-4)",
            "gradient_accumulation_steps": 1,
        },
        "warmup": args.warmup,
        "steps": args.steps,
        "step_time_s_median": common.median(step_times),
        "step_times_s": step_times,
        "ref_forward_time_s_median": common.median(ref_times),
        "train_step_time_s_median": common.median(train_times),
        "first_step_time_s": first_step_s,
        "compile_time_s": compile_warm - compile_before,
        "xla_compile_time_s": backend_warm - backend_before,
        "build_time_s": build_s,
        "tokens_per_s": 2 * args.batch * args.seq / common.median(step_times),
        "loss_first_last": [losses[0], losses[-1]],
        "loop_check": loop,
        "lora": lora,
        "memory": memory,
        "devices": [str(d) for d in jax.devices()],
        "notes": " ".join(notes),
    }
    common.emit(result)


if __name__ == "__main__":
    main()
