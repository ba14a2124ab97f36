"""Benchmarks: aioublk beside a peer in the same guest run, reported as ratios."""
