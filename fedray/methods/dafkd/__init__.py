"""DaFKD (Wang et al., CVPR 2023) over four modules: the method (:mod:`.method`), its typed state (:mod:`.types`), a
client's local training (:mod:`.client`) and the server's round (:mod:`.server`)."""

from fedray.methods.dafkd.method import DaFKD
from fedray.methods.dafkd.types import (DaFKDClientState, DaFKDModules, DaFKDParams, DaFKDPayload, DaFKDServerState,
                                        DaFKDUpload)

__all__ = ["DaFKD", "DaFKDClientState", "DaFKDModules", "DaFKDParams", "DaFKDPayload", "DaFKDServerState",
           "DaFKDUpload"]
