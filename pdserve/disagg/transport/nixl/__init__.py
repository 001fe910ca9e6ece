"""The NIXL KV transport: payloads written by RDMA (UCX) straight into decode's blocks, control
messages as NIXL notifications.

    receiver.py  NixlKVReceiver (decode): claims, grants, WRITTEN; its docstring has the protocol,
                 "Late writes" and "Trust"
    sender.py    NixlKVSender (prefill): claims, WRITEs on grants, DONE
    agent.py     the NIXL agent, registrations, polling and region addresses both sides share
    grants.py    decode's pool exposed one reservation at a time (registered at its first grant)
    staging.py   a staging buffer for payloads in another KV dtype than decode's pool
"""

from pdserve.disagg.transport.nixl.receiver import NixlKVReceiver
from pdserve.disagg.transport.nixl.sender import NixlKVSender

__all__ = ["NixlKVReceiver", "NixlKVSender"]
