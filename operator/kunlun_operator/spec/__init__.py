"""The custom resource parsed once into typed values.

``service`` is the ``KunlunInferenceService`` spec as frozen dataclasses (``parse_spec``) and the
service's identity (``ServiceRef``); ``fields`` reads and checks single fields, naming the path of
the one that is wrong. Nothing after parsing reads raw keys of the resource.
"""
