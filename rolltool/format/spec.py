"""The packed format's names: versions and the version rule, file names, statuses, dtypes.

No I/O and no records: what every other module of `rolltool.format` and every reader of a
packed directory spells the same way. A shard's name is `shard_name` and the one pattern that
parses it is `SHARD_PATTERN` (a rank folder: `RANK_DIR_PATTERN`).
"""

from __future__ import annotations

import re

import numpy as np

FORMAT = "rolltool-packed"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1, 2, 3, 4)
"""4: a shared-prefix pack (``--share-prefix``): a segment may continue another
(`SHARED_SEGMENT_ARRAYS`), and samples.parquet is as in 2 or 1 (by --epochs); a reader of 1-3
would serve a continuation as a sample of its own and a prefix as a whole sample, so it must
refuse them. 3: a hybrid-CP pack (``--hybrid-cp``): each row's CP GPUs are cut into sub-groups
(`HYBRID_ROW_ARRAYS`, `HYBRID_SEGMENT_ARRAYS`), and samples.parquet is as in 2 or 1 (by
--epochs); a reader of 1 and 2 would take its rows for plain ``--cp`` rows and serve wrong
views, so it must refuse them. 2: samples.parquet holds one row per (sample, epoch), with an
``epoch`` column (--epochs > 1); 1: one row per sample."""
HYBRID_VERSION = 3
"""The format version of every ``--hybrid-cp`` pack (`SUPPORTED_VERSIONS`)."""
SHARED_VERSION = 4
"""The format version of every ``--share-prefix`` pack (`SUPPORTED_VERSIONS`)."""
MANIFEST = "manifest.json"
SAMPLES = "samples.parquet"

STATUSES = (
    "trained",
    "uniform_dropped",
    "overlong_dropped",
    "leftover",
    "env_unweighted",
    "count_trimmed",
)
"""samples.parquet ``status``: trained, or why a sample was not (``count_trimmed``: left out of
its step so that --dp divides its samples, ``--equal-count-trim``)."""

PAD_SAMPLE = -1
"""``sample_index`` of a padding segment."""

TOKEN_ARRAYS = {"input_ids": np.int32, "loss_mask": np.uint8, "logprobs": np.float32}
"""Stored per token (9 bytes)."""
MAX_TOKEN_ID = int(np.iinfo(np.int32).max)
"""Largest token id a shard can hold (int32: 2**31 - 1)."""
SEGMENT_ARRAYS = {
    "seq_lens": np.int32,
    "sample_index": np.int64,
    "seg_advantage": np.float32,
    "seg_weight": np.float32,
}
"""Stored per segment: length, sample (-1: padding), advantage, loss weight per trainable token."""
ROW_ARRAYS = {"row_offsets": np.int64, "row_segments": np.int64}
"""Stored per row + 1: offsets into the token arrays and into the segment arrays."""
HYBRID_SEGMENT_ARRAYS = {"seg_cp_start": np.int32}
"""Stored per segment in ``--hybrid-cp`` packs only: the first GPU (of the row's C) of the
sub-group the segment belongs to (`rolltool.format.hybrid`)."""
HYBRID_ROW_ARRAYS = {"row_cp_groups": np.int32}
"""Stored per row x C in ``--hybrid-cp`` packs only, flat: row r's entries [r·C, (r+1)·C) are
each GPU's sub-group size (aligned powers of two partitioning the C GPUs)."""

SHARED_SEGMENT_ARRAYS = {"seg_parent": np.int32}
"""Stored per segment in ``--share-prefix`` packs only: the segment of the same row whose
tokens precede this one in every sample through it, as an index among the row's segments
(``parent[j] < j``), or -1 (`rolltool.format.prefix`). A prefix segment's ``sample_index`` is
its *representative*: the sample (of the lowest index in row order among those through it)
whose tokens it stores; its ``seg_advantage`` is that sample's and its ``seg_weight`` the sum
over every sample through it."""

READER_FIELDS = {
    "input_ids": np.int32,
    "position_ids": np.int32,
    "loss_mask": np.uint8,
    "advantages": np.float32,
    "logprobs": np.float32,
    "loss_weight": np.float32,
}
"""Per-token arrays of a row as the reader gives them (with ``cu_seqlens`` and ``sample_index``)."""


def shard_name(step: int, rank: int, part: int) -> str:
    """``rank-RRRR/step-SSSSSS-PP.safetensors``: zero-padded so names sort."""
    return f"rank-{rank:04d}/step-{step:06d}-{part:02d}.safetensors"


USAGE = (
    "loss = sum over this rank's rows of sum_t loss_weight[t] * token_loss[t]; the weights already "
    "divide by the step's denominators (over all ranks), so sum gradients over ranks. If your "
    "framework averages gradients over the dp ranks (DDP/FSDP do), multiply the loss by dp."
)


RANK_DIR_PATTERN = re.compile(r"rank-(\d{4,})")
"""A rank folder's name (``rank-RRRR``); group 1 is the rank."""
SHARD_PATTERN = re.compile(r"rank-(\d{4,})/step-(\d{6,})-(\d{2,})\.safetensors")
"""A shard's path relative to the packed directory (`shard_name`); groups: rank, step, part."""
