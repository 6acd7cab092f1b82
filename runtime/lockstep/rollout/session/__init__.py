"""TITO: the session server owns the tokens of multi-turn agent trajectories (§3).

Agents talk to the session server with ordinary OpenAI chat messages; the server renders only
what the agent appended, keeps every sampled token ID with its logprob and weight version, and hands
the trainer the exact rows that were served. Pure logic lives in `matcher` (is a replayed message
the stored one?), `tree` (token checkpoints, linear and branching sessions, sample assembly),
`mismatch` (the tito_session_mismatch diagnostic) and `affinity` (session -> replica); `server` is
the aiohttp edge and `engine` the adapter to the rollout engine.

Who calls it: the `lockstep sessions` CLI, lockstep.tasks.toolcalc's agent through the openai
client, and tests.
"""
