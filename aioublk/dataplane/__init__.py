"""The data plane: what C needs to serve a request without entering Python.

The maps a target returns (``maps``), the worker's C data plane made from
them (``plane``), the extent table a target such as qcow2 fills (``extents``),
how C owns the worker loop's wait (``cwait``), and how threads call into a
worker's loop (``crossloop``). Targets, the qcow2 engine and the queue
drivers build on it; it imports nothing above the ring."""
