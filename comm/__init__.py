"""fleetmpi's communication layer: topology, transports, collective algorithms, fusion, compression."""
from .topology import Topology

__all__ = ["Topology"]
