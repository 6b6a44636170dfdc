"""One delay-server node: its wiring, its role, the message operations it serves, the receiver,
replication, membership of its delay group, the connection pump, and its HTTP API and console."""
