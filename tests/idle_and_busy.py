"""Run the suites that wait on real servers again with every core busy (``make test-busy``,
after ``make test``, which ran them on a machine busy only with itself; not a step of
``.ci/run``, whose time it would push past CI's 20 minutes).

A test that needs a state mid-flight must hold it there (a backend it controls, a gate, a
fake clock), never hope that work is still running or already done: such a test passes on
one machine and fails on a faster or a busier one. This runs the gateway, autoscaler and
monitor tests, the ones that start servers and wait for them, beside one CPU-bound process
per core (``while True: pass`` at the same priority, so the tests get about half the CPU they
had), and fails if they fail; with ``--idle-too`` it runs them on the idle machine first. Each
run's time is printed.

    python tests/idle_and_busy.py [--idle-too] [pytest arguments, e.g. -k gateway]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SUITES = sorted(str(p) for pattern in ("test_gateway_*.py", "test_autoscale_*.py",
                                       "test_monitor_*.py")
                for p in Path(__file__).parent.glob(pattern))


def run_suites(label: str, extra: list[str]) -> bool:
    # No nbval and no cache: only these files, the same way both times, a file whole in one
    # worker per core as in make test (the servers they start take free ports).
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-o", "addopts=-ra --strict-markers", "-n", "auto", "--dist", "loadfile",
               *SUITES, *extra]
    started = time.monotonic()
    ok = subprocess.run(command).returncode == 0
    print(f"{label}: {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)", flush=True)
    return ok


def main() -> int:
    extra = [arg for arg in sys.argv[1:] if arg != "--idle-too"]
    idle = run_suites("idle", extra) if "--idle-too" in sys.argv[1:] else True
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(2)  # let the load average show them
        busy = run_suites(f"busy ({len(burners)} CPU-bound processes)", extra)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    return 0 if idle and busy else 1


if __name__ == "__main__":
    sys.exit(main())
