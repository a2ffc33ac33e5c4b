"""The run planner (tools/plan.py is its command line): memory per rank, communication, step time
and TFLOP/s per GPU of a run from its configs, checked against measurement (docs/performance.md)."""

from .hardware import *  # noqa: F401,F403
from .model import *  # noqa: F401,F403
