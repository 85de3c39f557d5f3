"""What many test files share, one copy each: NumPy references written from the papers
(``references``), the toy models and tasks (``toy_model``, ``rl_toy``, ``toy_agent``,
``model_families``), recipe helpers (``trainer_helpers``) and a jitted model call
(``compiled``). The runner of check scripts on fake devices stays beside the scripts it
runs (tests/fake_devices.py)."""
