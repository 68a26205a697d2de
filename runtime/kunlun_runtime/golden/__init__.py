"""Golden (numerical-equivalence) runs against HF ``transformers`` in FP32, layer by layer.

``runner`` compares one process's paged engine path; ``ranks`` does the same for a model split over
tensor-parallel ranks or pipeline stages. ``kunlun-runtime golden`` and tests/golden drive them.
"""
