"""`python -m lockstep.sandbox.helper`: the local sandbox's executor process (lockstep.sandbox.executor).

Who starts it: lockstep.sandbox.executor.Executor, once per local sandbox provider.
"""

import asyncio

from lockstep.sandbox.executor import serve

if __name__ == "__main__":
    asyncio.run(serve())
