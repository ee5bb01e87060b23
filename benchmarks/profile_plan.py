"""CPU profile of one ``autopar`` command, in process:

    python benchmarks/profile_plan.py OUT.prof plan llama3-70b --mesh 8x16x8 ... --no-cache

``python -m cProfile -m autopar`` writes nothing: the ``autopar`` program ends with
``os._exit`` after ``plan`` (autopar.tools.cli.run). This runs ``cli.main`` under
``cProfile.Profile(time.process_time)`` and dumps the stats (read them with ``pstats``).
Worker processes (side-by-side and isolated solves) are not in the profile.
"""

import cProfile
import sys
import time

if __name__ == "__main__":
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    from autopar.tools.cli import main

    code = main(sys.argv[2:], program=True)
    profile.disable()
    profile.dump_stats(sys.argv[1])
    sys.exit(code)
