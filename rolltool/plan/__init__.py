"""Pure planning: no files, no processes. Advantages within groups, batch assembly (`batches`),
mini-batches and epochs, the cost model (`workload`), the partition (ranks x micro-batches under
a hard token cap), layout-invariant loss weights, pack's config, and the run plan (`schedule`),
which is handed a mapper and never imports an engine.
"""
