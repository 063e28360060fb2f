"""Where work runs, in datatrove's executor style: this machine's processes (`local`) or a Ray
cluster (`ray`, with Ray Data's shuffle for the exchange, `ray_exchange`). Engines run the work
of `rolltool.packing` and `rolltool.plan`; nothing below imports an engine. Both are a
`base.Engine`; a run names its engine in a `config.ExecutionConfig` and opens it with
`config.open_engine`.
"""
