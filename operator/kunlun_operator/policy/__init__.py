"""What the cluster admits: the certified version matrix, the admission policy, memory feasibility.

``matrix`` parses and matches the driver/firmware/KML/runtime matrix (the default ships here as
``default_matrix.yaml``); ``admission_policy`` is the operator's policy on sources and images;
``feasibility`` estimates whether a model fits the cards it asks for.
"""
