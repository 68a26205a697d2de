"""kunlun_operator: the kopf operator that turns KunlunInferenceService objects into serving pods.

Layers (top depends on bottom only): ``handlers`` (the kopf shell: reads facts, applies, writes
status) > ``reconcile`` (pure) > ``builders`` (one pure ``build_*`` per owned kind) > ``spec``
(parses the custom resource into frozen dataclasses) > ``names``. Only the handler layer talks to
the Kubernetes API.
"""
