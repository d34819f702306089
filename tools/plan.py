#!/usr/bin/env python
"""Write, check, simulate and draw plan files: a schedule of your own for --pipeline-schedule plan:FILE.

    python tools/plan.py build --schedule weipipe --ranks 4 --groups 1 --num-layers 4 --num-microbatches 2 --out w.json
    python tools/plan.py validate examples/plans/relay-ring.json --grid
    python tools/plan.py simulate examples/plans/relay-ring.json --inter-bw 1.25GB/s
    python tools/plan.py draw examples/plans/relay-ring.json --out /tmp/relay-ring.png

See docs/writing-a-schedule.md; the logic is megatron_tawpipe/cli/plan_tool.py.
"""

import os
import sys

try:
    import megatron_tawpipe  # noqa: F401  (installed, or found below)
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.cli.plan_tool import main


def draw(*args, **kwargs):
    """tools/plot_schedule.py's drawing (imported when a PNG is asked for)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from plot_schedule import draw as draw_png

    return draw_png(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main(draw=draw))
