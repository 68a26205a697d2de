"""Profiler and configuration recommender (``kunlun-runtime tune``).

``profiler`` measures the real engine on the real model within a time budget; ``recommender`` is a
pure function from those measurements to engine options, each with the numbers behind it; ``cli``
registers the ``tune`` subcommand and writes the YAML that ``config_file.load_engine_options`` reads.
"""

from kunlun_runtime.tuning.measurements import Measurements
from kunlun_runtime.tuning.recommender import Recommendation, Targets, TuningError, recommend

__all__ = ["Measurements", "Recommendation", "Targets", "TuningError", "recommend"]
