"""How a service says that its settings can never work, so that whoever restarts it does not.

A crash that may pass (a SIGKILL, out of memory, an engine that broke) exits with any other code and
is restarted. A setting that can never work (a tensor-parallel size that does not divide the model's
heads, a model file missing a tensor, a hardware profile that does not exist, a CUDA device on a
machine without one, an unreadable API keys file) exits with CONFIGURATION_ERROR after one line on
stderr that starts with the service's name and says what is wrong: `iterserve up` then stops
everything and exits 2 with that line, as it does for the settings it checks itself.
"""

import sys

CONFIGURATION_ERROR = 78  # sysexits.h's EX_CONFIG


def configuration_error(message: str) -> SystemExit:
    """Say it (one line on stderr), and the exit to raise: `raise configuration_error(...) from None`."""
    sys.stderr.write(message.rstrip() + "\n")
    sys.stderr.flush()
    return SystemExit(CONFIGURATION_ERROR)
