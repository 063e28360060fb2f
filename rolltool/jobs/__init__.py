"""One module per command, wiring readers -> pure stages -> writers: `pack`, `advantages`,
`synth` (and `rewrite`, the advantages job's Parquet copy). The Python API behind the CLI:
config objects and paths in, a report dict out; a job never prints.
"""

from rolltool.jobs.advantages import ADVANTAGE_COLUMNS, ROW_GROUP, ROW_GROUP_BYTES, run_advantages
from rolltool.jobs.synth import run_synth

__all__ = ["ADVANTAGE_COLUMNS", "ROW_GROUP", "ROW_GROUP_BYTES", "run_advantages", "run_synth"]
