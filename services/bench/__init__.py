"""`iterserve bench`: an open-loop load generator for the gateway, and the experiments of
benchmarks/results/ (Orca against request-level batching, serving overhead, scaling, cancels)."""
