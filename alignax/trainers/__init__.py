"""Trainers: the one map of algorithms (``algorithms``), the API over it (``api``), the engine
every run shares, and two wings.

- :mod:`alignax.trainers.algorithms`: ``ALGORITHMS``, an entry per algorithm with every fact
  about it (family, model kinds, builder, sections, data formats, frozen models, its own
  config rules, what the estimator counts); nothing else spells an algorithm's name.
- :mod:`alignax.trainers.api`: ``load_config``, ``train``, ``evaluate``, ``export`` for every
  algorithm (and the map, re-exported); ``alignax.cli`` calls it.
- :mod:`alignax.trainers.config`: the typed run config (``TrainConfig``); ``api.load_config``
  reads and validates one (:mod:`alignax.trainers.validation`).
- ``engine/``: the run session (output dir, writers, checkpoints, resume, SIGTERM), the host
  loop, the jitted step, optimiser, shared-prompt packing, model/tokenizer/mesh setup.
- ``offline/``: SFT, reward-model and preference (DPO family, KTO) tasks on fixed data.
- ``online/``: rollout → reward → advantage → update in four rooms (``actors``, ``collect``,
  ``update``, ``trainer``); the GRPO and PPO families as
  :class:`~alignax.trainers.online.algorithm.OnlineAlgorithm` bundles; monitoring.

Both wings' trainers share one program seam: ``state, frozen = trainer.start()`` and the
compiled step ``trainer.step(state, frozen, batch)``.
"""
