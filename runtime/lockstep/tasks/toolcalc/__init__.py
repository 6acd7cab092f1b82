"""toolcalc: a multi-turn, tool-using toy environment (the agent must call `calc`, then answer).

Why it exists: TITO matters only when a trajectory spans several turns with environment text in
between. This task makes that the normal case on one CPU machine: the prompt asks for an arithmetic
result ("calc 12+7"), the agent is expected to call the `calc` tool, read its result and answer with
the number. The agent talks to the session server through the real `openai` client, so every run
exercises the token-exact path.

Parts: `env` (items, the calc tool, the reward) and `agent` (the episode loop, an AgentFn).
Who calls it: `lockstep run` through spec.agent.agentFunction / rewardFunction (see
lockstep.rollout.session.local for the in-process session server), tests.
"""

from lockstep.tasks.toolcalc.agent import run_episode
from lockstep.tasks.toolcalc.env import CALC_TOOL, ToolCalc, calc, reward, score

__all__ = ["CALC_TOOL", "ToolCalc", "calc", "reward", "run_episode", "score"]
