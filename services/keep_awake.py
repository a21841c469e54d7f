"""Keeps one CPU from going idle, at the lowest priority there is: `iterserve keep-awake`, which
`iterserve up --scheduler-cpus` runs once per scheduler CPU, pinned to it.

The scheduler sleeps between results (3.4 ms with one worker of 3.4 ms steps) and wakes for a few
hundred microseconds of work. A CPU left idle meanwhile halts (a virtual machine's vCPU gives its
core back to the host; a bare-metal core enters a deeper C-state), and the next turn runs with
cold caches: measured alone, the same worker-iterations cost 242-270 µs with a 3 ms sleep after
each, against 126 back to back and 149-174 with this loop on the CPU
(`benchmarks/scheduler_cpu.py --idle-ms 3`). This loop never sleeps, so the CPU never halts, and
under SCHED_IDLE it runs only when nothing else wants the CPU: the scheduler takes it back the
moment a result wakes it. It is what a latency-tuned host does with idle states off (tuned's
latency-performance profile, `idle=poll`), for one CPU, without privileges.
"""

import os


def main() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (lowering one's priority needs no privilege)
    while True:
        pass


if __name__ == "__main__":
    main()
