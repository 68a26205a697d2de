"""The custom resource parsed once into typed values.

``service`` is the ``KunlunInferenceService`` as frozen dataclasses: ``parse_service`` reads the
whole object once (its identity ``ServiceRef``, its spec ``InferenceSpec`` or the ``SpecError``
naming the bad field, its last status); ``fields`` reads and checks single fields, naming the path
of the one that is wrong; ``quantity`` turns quantities into numbers with units (``20Gi`` → bytes);
``operator_config`` is the operator's own configuration that shapes what it builds. Nothing after
parsing reads raw keys of the resource.
"""
