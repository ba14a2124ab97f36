"""The benchmarks' reports and the suites (bench/), without running them."""
