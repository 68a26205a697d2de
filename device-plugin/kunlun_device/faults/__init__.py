"""The node agent's answer to card faults: pod conditions, Events, quarantine, the node taint.

Pure decisions live in `quarantine`, `history`, `verdicts` and `taint`; `ledger` decides what the
Node's quarantine and failure annotations must say; `state` is the plugin's state file (read back at
start, and the exporter's view); `responder.FaultResponder` is the thin shell that reads PodResources
and the Node and writes to the Kubernetes API.
"""

from kunlun_device.faults.quarantine import QuarantinePolicy
from kunlun_device.faults.responder import FaultResponder
from kunlun_device.faults.state import FaultState, read_quarantine_file, read_state_file

__all__ = ["FaultResponder", "FaultState", "QuarantinePolicy", "read_quarantine_file", "read_state_file"]
