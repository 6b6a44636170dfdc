"""The node's HTTP API and web console (Starlette on hypercorn's trio worker)."""
