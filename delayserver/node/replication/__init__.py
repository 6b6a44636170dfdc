"""Master/slave replication: the slave pulls message_log and dispatch_log from its master.

- `wire`: the SYNC_MESSAGE_LOG and SYNC_DISPATCH_LOG payloads and their strict decoders;
- `master`: the master's answers to the pulls;
- `slave`: the slave's pulling task, which applies only dispatch records naming messages it holds;
- `slaves`: what the master knows of its slaves (durable offsets for the cleaner, registered ids,
  max_slave_lag) and the sync-mode gate (`replication = "sync"`: a producer's ack waits for
  `min_insync_replicas` slaves to fsync its records, else NOT_ENOUGH_REPLICAS).

Only the master delivers; a slave takes no writes (NOT_MASTER).
"""
from delayserver.node.replication.master import MAX_SYNC_BYTES, Master
from delayserver.node.replication.slave import Slave
from delayserver.node.replication.slaves import InSync, Registry, SlaveStates

__all__ = ["InSync", "MAX_SYNC_BYTES", "Master", "Registry", "Slave", "SlaveStates"]
