"""The node agent's answer to card faults: pod conditions, Events, quarantine, the node taint.

Pure decisions live in `quarantine`, `verdicts` and `taint`; `responder.FaultResponder` is the
thin shell that reads PodResources and the Node and writes to the Kubernetes API.
"""

from kunlun_device.faults.quarantine import QuarantinePolicy, read_quarantine_file
from kunlun_device.faults.responder import FaultResponder

__all__ = ["FaultResponder", "QuarantinePolicy", "read_quarantine_file"]
