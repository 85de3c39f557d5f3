"""Multi-turn rollouts: the model and an environment take turns, on the on-device sampler.

:class:`EnvSampler` has :class:`~alignax.sampling.scored.ScoredSampler`'s interface
(``sample(state, prompt_batch, rng, config=None) -> (Groups, seconds, model tokens)``),
so the online trainer, its dynamic sampling and the generation-based evaluation use it
unchanged. For each of the ``G`` rows of a prompt record it makes a fresh environment
(``reset(record)`` gives the conversation; the prompt is its chat-template rendering with
the environment's tools, left-padded to ``prompt_len``), then per turn:

1. :func:`alignax.sampling.multiturn.generate_turn` prefills the new context into each
   row's KV cache and draws until a stop token or ``max_turn_tokens`` (one compiled
   program for every turn after the first); on the first turn the ``G`` rows of a record
   share one prefill of the prompt when their environments gave the same prompt (the
   usual case; a stochastic ``reset`` makes them differ, and then each row prefills its own);
2. on the host, each live row's turn is decoded and given to its environment
   (``step``); the reply's text (:func:`alignax.envs.chat.observation_text`) is
   tokenised and appended to the trajectory with action mask 0;
3. rows whose trajectory ended drop out; the loop stops when none is live.

A trajectory ends with one reason, counted per row in ``Groups.trajectory`` as
``ended_<reason>``: ``done`` (the environment said so), ``max_turns``,
``max_total_tokens`` (the trajectory budget ``config.max_new_tokens`` is full: the
model's tokens past it are cut, or the observation would not fit), ``turn_budget`` (a
turn drew ``max_turn_tokens`` tokens without a stop token), ``observation_too_long``
(an observation over ``max_observation_tokens``), ``env_error`` (``step`` raised, or
returned something that is not ``(messages, finite reward, done, info)``; logged). A
trajectory is ``stopped`` (not truncated, for ``rewards.mask_truncated``) unless it
ended on ``max_total_tokens`` or ``turn_budget``.

Output layout (``Groups``): ``tokens [R, N]`` the trajectory after the prompt, contiguous,
then ``pad_id``; ``response_mask`` 1 on its real tokens (what a forward pass attends);
``action_mask`` 1 on the model's tokens; ``sampler_logps`` the sampler's log-probs there,
0 on observations. ``rewards`` is the sum of the step rewards; ``components["correct"]``
the last ``info["correct"]`` (0 when never given); ``trajectory`` per-row ``turns``,
the summed :data:`alignax.envs.base.INFO_COUNTS`, ``env_s`` (seconds in ``step``) and the
end reasons.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from alignax.envs.base import INFO_COUNTS, EnvError, check_messages
from alignax.envs.chat import observation_text, render
from alignax.envs.registry import env_spec
from alignax.parallel.multihost import allgather_rows, local_rows
from alignax.sampling.multiturn import generate_turn, turn_cache_length
from alignax.sampling.sampler import SamplingConfig
from alignax.sampling.scored import Groups

log = logging.getLogger("alignax")

END_REASONS = ("done", "max_turns", "max_total_tokens", "turn_budget", "observation_too_long", "env_error")
_TRUNCATED = ("max_total_tokens", "turn_budget")


@dataclasses.dataclass
class _Row:
    """One trajectory on the host while it is being played."""

    env: Any
    history: list[dict]
    tokens: list[int] = dataclasses.field(default_factory=list)
    actions: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    correct: float = 0.0
    turns: int = 0
    counts: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(INFO_COUNTS, 0.0))
    env_s: float = 0.0
    ended: str | None = None

    def append(self, tokens, action: int, logps=None) -> None:
        self.tokens.extend(int(t) for t in tokens)
        self.actions.extend([action] * len(tokens))
        self.logps.extend([0.0] * len(tokens) if logps is None else [float(x) for x in logps])


class EnvSampler:
    """Plays multi-turn trajectories for prompt batches; see the module docstring.

    Args:
      graphdef, model_config: the policy's graph and model config.
      tokenizer: renders conversations (its chat template) and decodes turns.
      make_env: a callable making a fresh environment (:func:`alignax.envs.env_factory`).
      config: sampling settings of the rollout; ``max_new_tokens`` is the trajectory budget
        ``N`` after the prompt, ``num_samples`` the trajectories per record.
      prompt_len: the width ``P`` prompts are left-padded to (``data.max_prompt_length``).
      max_turns / max_turn_tokens / max_observation_tokens: ``env.*`` (``max_turn_tokens``
        ``None``: ``N``).
      share_prompt: prefill a record's prompt once for its ``G`` rows when they are the
        same (``False``: once per row, the reference the tests compare with).
    """

    def __init__(self, graphdef: nnx.GraphDef, model_config, tokenizer, make_env: Callable[[], Any],
                 config: SamplingConfig, *, mesh, place: Callable[[np.ndarray], jax.Array], prompt_len: int,
                 max_turns: int, max_turn_tokens: int | None = None, max_observation_tokens: int = 64,
                 share_prompt: bool = True):
        self.graphdef, self.model_config, self.tokenizer = graphdef, model_config, tokenizer
        self.make_env, self.config, self.mesh, self.place = make_env, config, mesh, place
        self.prompt_len, self.max_turns = prompt_len, max_turns
        self.max_turn_tokens, self.max_observation_tokens = max_turn_tokens, max_observation_tokens
        self.share_prompt = share_prompt
        self.reward_models = None  # the scorer interface's: environments give the rewards
        self.eos = tokenizer.eos_token_id

    def _prompt(self, row: _Row, record: Mapping[str, Any], index: int) -> list[int]:
        where = f"env.name={env_spec(row.env)!r}: reset(record {index})"
        try:
            returned = row.env.reset(record)
        except Exception as err:  # the environment's own code: name it, its record and what it raised
            raise EnvError(f"{where} raised {type(err).__name__}: {err}") from err
        try:
            messages = check_messages(returned, where=where)
        except TypeError as err:
            raise EnvError(str(err)) from None
        row.history = messages
        ids = list(self.tokenizer.encode(render(self.tokenizer, messages, row.env.tools, add_generation_prompt=True),
                                         add_special_tokens=False))
        if len(ids) > self.prompt_len:
            raise ValueError(f"record {index}: the environment's prompt (with its tools) has {len(ids)} tokens; "
                             f"data.max_prompt_length is {self.prompt_len}")
        return ids

    def _step(self, row: _Row, text: str, turn_ended_with_eos: bool, last_turn: bool) -> list[int] | None:
        """Give the turn to the environment; the observation's tokens, or ``None`` when the
        trajectory ended (``row.ended`` says why)."""
        assistant = {"role": "assistant", "content": text}
        start = time.perf_counter()
        try:
            result = row.env.step(assistant)
            new_messages, reward, done, info = result
            new_messages = check_messages(new_messages, where=f"{type(row.env).__name__}.step")
            reward = float(reward)
            if not math.isfinite(reward):
                raise ValueError(f"non-finite reward {reward}")
            info = dict(info or {})
        except Exception as err:  # a broken environment ends this trajectory, not the run
            row.env_s += time.perf_counter() - start
            log.warning("environment env.name=%r failed on a turn, the trajectory ends (env_error): %s: %s",
                        env_spec(row.env), type(err).__name__, err)
            row.ended = "env_error"
            return None
        row.env_s += time.perf_counter() - start
        row.reward += reward
        for key in INFO_COUNTS:
            row.counts[key] += float(info.get(key, 0))
        if "correct" in info:
            row.correct = float(info["correct"])
        history = row.history
        row.history = [*history, assistant, *new_messages]
        if done:
            row.ended = "done"
            return None
        if last_turn:
            row.ended = "max_turns"
            return None
        text = observation_text(self.tokenizer, history, assistant, new_messages, row.env.tools,
                                turn_ended_with_eos=turn_ended_with_eos)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def sample(self, state: nnx.State, prompt_batch: Mapping[str, Any], rng: jax.Array,
               config: SamplingConfig | None = None) -> tuple[Groups, float, int]:
        """Trajectories for one prompt batch (``references`` are the records), and
        ``(seconds, model tokens drawn)``; the seconds include the environment's."""
        config = config or self.config
        start = time.perf_counter()
        G, N, P = config.num_samples, config.max_new_tokens, self.prompt_len
        T = min(self.max_turn_tokens or N, N)
        L = self.max_observation_tokens + 1  # the model's last token, then the observation
        turn_config = dataclasses.replace(config, max_new_tokens=T, num_samples=1)
        if P + N > self.model_config.max_position_embeddings:
            raise ValueError(f"data.max_prompt_length {P} + the trajectory budget rollout.max_new_tokens {N} exceeds "
                             f"the model's max_position_embeddings {self.model_config.max_position_embeddings}")
        records = list(prompt_batch["references"])
        real = np.asarray(prompt_batch.get("example_mask", np.ones(len(records))))
        R = len(records) * G
        rows, prompts = [], []
        for r in range(R):
            b = r // G
            if real[b] > 0:
                row = _Row(env=self.make_env(), history=[])
                prompts.append(self._prompt(row, records[b], b))
            else:  # a padding row of an evaluation batch: never played
                row = _Row(env=None, history=[], ended="done")
                mask = np.asarray(prompt_batch["prompt_attention_mask"][b]) > 0
                prompts.append(np.asarray(prompt_batch["prompt_tokens"][b])[mask][-P:].tolist())
            rows.append(row)
        chunk, chunk_mask = _left_pad(prompts, P, config.pad_id)
        same = all(prompts[r] == prompts[r - r % G] for r in range(R))
        # the flag is a static argument of the compiled turn: every process takes the same
        shared = G if G > 1 and self.share_prompt and np.all(allgather_rows(np.array([same]))) else 1
        cache_len = turn_cache_length(P, L, T, self.max_turns)
        cache = position = None
        used_slots = 0
        gen_tokens = 0
        for turn in range(self.max_turns):
            live = np.array([row.ended is None for row in rows])
            if not np.any(allgather_rows(np.array([live.any()]))):  # processes generate together
                break
            if used_slots + chunk.shape[1] + T - 1 > cache_len:  # by construction never; a clamped write is silent
                raise RuntimeError(f"multi-turn cache overflow: {used_slots} + {chunk.shape[1]} + {T - 1} > {cache_len}")
            with jax.set_mesh(self.mesh):
                out = generate_turn(self.graphdef, state, cache, position, self.place(chunk), self.place(chunk_mask),
                                    self.place(live), jax.random.fold_in(rng, turn), config=turn_config,
                                    cache_len=cache_len, shared=shared if cache is None else 1)
            cache, position = out.cache, out.position
            tokens, mask, logps, stopped, steps = (np.asarray(local_rows(x)) if x.ndim else int(x) for x in (
                out.tokens, out.response_mask, out.sampling_logps, out.stopped, out.num_steps))
            used_slots += chunk.shape[1] + steps - 1
            chunk = np.full((R, L), config.pad_id, np.int32)
            chunk_mask = np.zeros((R, L), np.int32)
            for r in np.flatnonzero(live):
                row = rows[r]
                drawn = tokens[r][mask[r] > 0]
                row.append(drawn, 1, logps[r][mask[r] > 0])
                row.turns += 1
                gen_tokens += len(drawn)
                if len(row.tokens) > N or (len(row.tokens) == N and not stopped[r]):
                    del row.tokens[N:], row.actions[N:], row.logps[N:]
                    row.ended = "max_total_tokens"
                    continue
                if not stopped[r]:
                    row.ended = "turn_budget"
                    continue
                ended_with_eos = int(drawn[-1]) == self.eos
                text = self.tokenizer.decode(drawn[:-1] if ended_with_eos else drawn, skip_special_tokens=True)
                observation = self._step(row, text, ended_with_eos, last_turn=turn + 1 == self.max_turns)
                if observation is None:
                    continue
                if len(observation) > self.max_observation_tokens:
                    row.ended = "observation_too_long"
                elif len(row.tokens) + len(observation) >= N:  # no room left for a model token
                    row.ended = "max_total_tokens"
                else:
                    row.append(observation, 0)
                    piece = [int(drawn[-1]), *observation]
                    chunk[r, L - len(piece):] = piece
                    chunk_mask[r, L - len(piece):] = 1
        for row in rows:  # the loop ran max_turns turns; every live row ended in its last step
            row.ended = row.ended or "max_turns"
        groups = self._groups(rows, records, prompts, config)
        return groups, time.perf_counter() - start, gen_tokens

    def _groups(self, rows: list[_Row], records, prompts, config: SamplingConfig) -> Groups:
        R, N, P, G = len(rows), config.max_new_tokens, self.prompt_len, config.num_samples
        prompt_tokens, prompt_mask = _left_pad(prompts, P, config.pad_id)
        tokens = np.full((R, N), config.pad_id, np.int32)
        response_mask = np.zeros((R, N), np.int32)
        action_mask = np.zeros((R, N), np.int32)
        sampler_logps = np.zeros((R, N), np.float32)
        for r, row in enumerate(rows):
            n = len(row.tokens)
            tokens[r, :n], response_mask[r, :n] = row.tokens, 1
            action_mask[r, :n], sampler_logps[r, :n] = row.actions, row.logps
        completions = self.tokenizer.batch_decode([row.tokens for row in rows], skip_special_tokens=True)
        trajectory = {"turns": np.array([row.turns for row in rows], np.float64),
                      "env_s": np.array([row.env_s for row in rows], np.float64)}
        for key in INFO_COUNTS:
            trajectory[key] = np.array([row.counts[key] for row in rows], np.float64)
        for reason in END_REASONS:
            trajectory[f"ended_{reason}"] = np.array([row.ended == reason for row in rows], np.float64)
        return Groups(
            prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens, response_mask=response_mask,
            sampler_logps=sampler_logps, stopped=np.array([row.ended not in _TRUNCATED for row in rows]),
            references=[records[r // G] for r in range(R)], completions=completions,
            rewards=np.array([row.reward for row in rows], np.float32),
            components={"correct": np.array([row.correct for row in rows], np.float64)},
            action_mask=action_mask, trajectory=trajectory,
        )


def _left_pad(sequences, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for i, seq in enumerate(sequences):
        if len(seq):
            tokens[i, length - len(seq):], mask[i, length - len(seq):] = seq, 1
    return tokens, mask


def trajectory_figures(groups: Groups, generation_s: float) -> dict[str, float]:
    """Monitoring of a multi-turn rollout (host floats): turns and tool calls per
    trajectory, malformed-call and tool-error rates (per call), the share of each end
    reason, and the environment's time against the generation's."""
    t = groups.trajectory
    calls = float(np.sum(t["tool_calls"]))
    env_s = float(np.sum(t["env_s"]))
    out = {"env/turns_per_trajectory": float(np.mean(t["turns"])),
           "env/tool_calls_per_trajectory": float(np.mean(t["tool_calls"])),
           "env/malformed_call_rate": float(np.sum(t["malformed_calls"])) / calls if calls else 0.0,
           "env/tool_error_rate": float(np.sum(t["tool_errors"])) / calls if calls else 0.0,
           "env/env_s": env_s, "env/generation_s": max(generation_s - env_s, 0.0),
           "env/model_token_fraction": float(groups.actions().sum() / max(groups.response_mask.sum(), 1))}
    for reason in END_REASONS:
        out[f"env/ended_{reason}"] = float(np.mean(t[f"ended_{reason}"]))
    return out
