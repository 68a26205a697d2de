"""Pure builders, one module per owned kind: ``build_<kind>(ref, spec, ...) -> dict`` manifests.

They never talk to the API and never read the clock; the same input gives the same dict.
"""
