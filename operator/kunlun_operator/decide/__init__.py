"""The operator's decisions as pure functions: facts in, plan or verdict out.

``reconcile`` turns a parsed service and the cluster's facts into objects, status and events;
``admission`` gives the verdict on a custom resource; ``health_gate``, ``image_pull``, ``replicas``,
``nodes`` and ``status`` decide one concern each; ``render`` is the dry run: the webhook's review
and the reconcile for a fresh cluster. Nothing here talks to the API or reads the clock.
"""
