"""A queue's serving machinery: what a device is asked to be (``options``),
the C data plane's maps (``dataplane``, ``extents``), the lifecycle table,
the driver core and the per-I/O driver, and the worker threads. The batch
driver is ``aioublk/batch.py``, the ring ``aioublk/ring.py``."""
