"""Rollout: producing scored trajectories on the engines.

Why it exists: everything between "a prompt" and "a complete, scored group" lives here: the default
single-turn generate and the group runner (generate.py), the user extension points (plugins.py),
the fully-async worker, buffer and staleness measures (async_worker.py, buffer.py, staleness.py) and
the TITO session server (session/).

Who calls it: lockstep.driver.
"""
