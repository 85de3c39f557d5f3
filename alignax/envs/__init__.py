"""Multi-turn environments and tools for agentic RL.

- :mod:`alignax.envs.base`: the protocol (``reset(record) -> messages``,
  ``step(message) -> (messages, reward, done, info)``).
- :mod:`alignax.envs.tools`: tools with JSON schemas, Hermes/Qwen ``<tool_call>`` parsing.
- :mod:`alignax.envs.calculator`: the AST calculator and its arithmetic environment.
- :mod:`alignax.envs.feedback`: "wrong, try again" with a turn penalty.
- :mod:`alignax.envs.chat`: prompts with tools and observations through the chat template.
- :mod:`alignax.envs.registry`: names (``env.name``) -> environment classes.
- :mod:`alignax.envs.rollout`: multi-turn rollouts on the on-device sampler.
"""

from alignax.envs.base import INFO_COUNTS, Environment, Step
from alignax.envs.calculator import CalculatorEnv, calculator_tool, evaluate_arithmetic
from alignax.envs.config import EnvConfig
from alignax.envs.feedback import RetryEnv
from alignax.envs.registry import ENVIRONMENTS, env_factory
from alignax.envs.tools import Tool, ToolCall, ToolError, parse_tool_calls, run_tool_calls, tools_system_prompt

__all__ = ["ENVIRONMENTS", "INFO_COUNTS", "CalculatorEnv", "EnvConfig", "Environment", "RetryEnv", "Step", "Tool",
           "ToolCall", "ToolError", "calculator_tool", "env_factory", "evaluate_arithmetic", "parse_tool_calls",
           "run_tool_calls", "tools_system_prompt"]
