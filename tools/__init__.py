"""The project's own development tooling, kept out of the wheel: a kublk builder for
the benchmarks (`kublk`), a throwaway Ceph cluster for the rbd tests (`ceph`) and
the demo `scripts/demo` runs (`demo`). Importable from the repository root (pytest's
`pythonpath`, `python -m tools.X`, `python -m bench.X`)."""
