"""kunlun_operator: the kopf operator that turns KunlunInferenceService objects into serving pods.

One folder a layer (top depends on bottom only): ``shell`` (kopf handlers, the controller, the API
client, the CLI and ``render``: the only layer that talks to the Kubernetes API) > ``decide`` (pure
decisions: reconcile, admission, health gates, replacements, status) > ``builders`` (one pure
``build_*`` per owned kind) > ``policy`` (version matrix, admission policy, feasibility) > ``spec``
(the custom resource parsed once into typed values) > ``errors`` | ``names``.
"""
