"""All experiments of benchmarks/results/ in one command (the same as `iterserve bench experiments`):

    .venv/bin/python benchmarks/experiments.py [--quick]

See services/bench/experiments.py for what each experiment measures.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.experiments import main  # noqa: E402

if __name__ == "__main__":
    main()
