"""Profiler and configuration recommender (``kunlun-runtime tune``).

``profiler`` measures the real engine on the real model within a time budget; ``recommender`` is a
pure function from those measurements to engine options, each with the numbers behind it (its
``placement`` chooses the tensor- and pipeline-parallel sizes from the per-card arithmetic of
``stages``); ``cli`` registers the ``tune`` subcommand and writes the YAML that
``config_file.load_engine_options`` reads.
"""

from kunlun_runtime.tuning.measurements import Measurements
from kunlun_runtime.tuning.recommender import Recommendation, recommend
from kunlun_runtime.tuning.targets import Targets, TuningError

__all__ = ["Measurements", "Recommendation", "Targets", "TuningError", "recommend"]
