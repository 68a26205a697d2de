"""The operator's shell: everything that talks to the Kubernetes API or the outside world.

``cli`` parses flags and starts kopf; ``handlers`` are the kopf handlers; ``controller`` gathers the
facts a reconcile needs and applies its plan through ``apply`` and ``kube``; ``pod_gates`` writes the
readiness-gate conditions ``decide`` chose; ``metrics`` is the operator's Prometheus registry;
``render`` is the offline dry run. Decisions are made in ``decide``, never here.
"""
