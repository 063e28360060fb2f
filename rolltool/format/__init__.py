"""The packed format, in one place: the contract between rolltool's writers and its readers.

A packed directory (`rolltool.packed.writer` writes it, `rolltool.packed.reader` reads it)::

    packed/
      manifest.json                         `Manifest`, written last: the commit mark
      samples.parquet                       one row per input sample: where it went, or why not
      rank-0003/step-000012-00.safetensors  rank 3's rows of step 12, part 00 (`shard_name`)

- `spec`: names, versions and the version rule, statuses, dtypes, shard and rank names and the
  one pattern that parses them;
- `codec`: frozen dataclass records <-> JSON, for every record and config;
- `records`: the manifest and its typed records, parsed and checked once in
  `Manifest.from_json`;
- `layout`: samples -> packed rows (cu_seqlens, positions, padding segments);
- `split`: one row's view per GPU under sequence / context parallelism;
- `hybrid`: ``--hybrid-cp`` rows: each row's CP GPUs cut into sub-groups, and each GPU's view;
- `shards`: one (step, rank)'s rows as flat arrays and back.

No I/O policy lives here: where files go and how they are committed is `rolltool.storage`'s.
The names below are the package's API (``from rolltool.format import Manifest``).
"""

from rolltool.format.codec import CodecError, from_json, to_json
from rolltool.format.records import (
    AdvantagesRecord,
    Denominators,
    FileRecord,
    HybridRecord,
    InputRecord,
    LossRecord,
    Manifest,
    PartialStep,
    PlanRecord,
    RankRecord,
    ReadRecord,
    RecordedAdvantages,
    RecordedConfig,
    RecordedModel,
    RecordedSteps,
    RecordedWorkload,
    SampleCounts,
    ShardRef,
    SharedRecord,
    SharedTokens,
    StepCounts,
    StepRecord,
    is_packed_dir,
    listed_files,
    packed_doc,
)
from rolltool.format.spec import (
    FORMAT,
    FORMAT_VERSION,
    HYBRID_ROW_ARRAYS,
    HYBRID_SEGMENT_ARRAYS,
    HYBRID_VERSION,
    MANIFEST,
    MAX_TOKEN_ID,
    PAD_SAMPLE,
    RANK_DIR_PATTERN,
    READER_FIELDS,
    ROW_ARRAYS,
    SAMPLES,
    SEGMENT_ARRAYS,
    SHARD_PATTERN,
    SHARED_SEGMENT_ARRAYS,
    SHARED_VERSION,
    STATUSES,
    SUPPORTED_VERSIONS,
    TOKEN_ARRAYS,
    USAGE,
    shard_name,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HYBRID_ROW_ARRAYS",
    "HYBRID_SEGMENT_ARRAYS",
    "HYBRID_VERSION",
    "MANIFEST",
    "MAX_TOKEN_ID",
    "PAD_SAMPLE",
    "RANK_DIR_PATTERN",
    "READER_FIELDS",
    "ROW_ARRAYS",
    "SAMPLES",
    "SEGMENT_ARRAYS",
    "SHARD_PATTERN",
    "SHARED_SEGMENT_ARRAYS",
    "SHARED_VERSION",
    "STATUSES",
    "SUPPORTED_VERSIONS",
    "TOKEN_ARRAYS",
    "USAGE",
    "AdvantagesRecord",
    "CodecError",
    "Denominators",
    "FileRecord",
    "HybridRecord",
    "InputRecord",
    "LossRecord",
    "Manifest",
    "PartialStep",
    "PlanRecord",
    "RankRecord",
    "ReadRecord",
    "RecordedAdvantages",
    "RecordedConfig",
    "RecordedModel",
    "RecordedSteps",
    "RecordedWorkload",
    "SampleCounts",
    "ShardRef",
    "SharedRecord",
    "SharedTokens",
    "StepCounts",
    "StepRecord",
    "from_json",
    "is_packed_dir",
    "listed_files",
    "packed_doc",
    "shard_name",
    "to_json",
]
