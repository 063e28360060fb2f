"""The rollout schema: check the input and extract its light per-sample columns.

One Parquet row is one trainable sample (a branch of a rollout). `scan` streams the input once,
checks every rule and returns a `Rollouts` holding the light columns (ids, env, reward, lengths,
finish times, a given advantage) as NumPy arrays. Token lists are looked at batch by batch and
never kept. Every problem is reported together (file, column, sample) before anything is written,
each with a stable kind code (`rolltool.util.problems.Problem`)::

    columns.py    schema rules, decided from the Parquet footers before a row is read
    rows.py       row rules, one record batch at a time
    across.py     cross-row rules, over the whole input's light columns
    rollouts.py   `Rollouts` (the contract) and `scan` (the driver)

Rules and their kinds:

- schema, per file: ``column.missing`` (``group_id``, ``reward``, and ``input_ids`` +
  ``loss_mask`` or ``prompt_ids`` + ``response_ids``), ``column.type`` (a known column of the
  wrong type);
- schema, across files: ``input.format`` (one token format), ``id.type`` (an id column integer in
  one file and string in another: 1 and "1" are not the same id, and we do not guess),
  ``column.partial`` (``rollout_id``, ``env``, ``finished_at``, ``advantage`` in every file or
  in none). The first two stop before any row is read;
- rows: ``null`` (a null where a value is required; a null ``logprobs`` list is fine: logprobs
  are optional per sample), ``reward.value`` / ``finished_at.value`` / ``advantage.value``
  (not finite), ``loss_mask.length`` / ``logprobs.length`` (not as long as the sequence),
  ``loss_mask.value`` (not 0/1), ``token.range`` (negative, null or above 2**31 - 1: packed as
  int32), ``logprobs.value`` (null or non-finite inside a list), ``logprobs.range`` /
  ``advantage.range`` (finite, but beyond float32's +-3.4e38: they are packed as float32 and
  would become inf), ``sequence.empty``;
- across rows: ``sample_id.duplicate``, ``rollout.reward`` / ``rollout.advantage`` (branches of
  one rollout disagree), ``group.env`` (a group spread over two envs).

Samples with no trainable token are allowed but counted and warned about.

A sample's first token is never a target: nothing precedes it, so no logit predicts it (HF and
TRL label it -100). ``Rollouts.trainable`` counts a sample's targets, its ``loss_mask`` ones but
token 0's, and the packed ``loss_mask`` is cleared there (`rolltool.fetch.tokens`): every T and
every weight agrees with the label count a trainer sees. The scan warns how many it cleared.

Identity: a group is its ``group_id``; a rollout is the pair (``group_id``, ``rollout_id``), so
rollout ids may restart in every group; without ``rollout_id`` every row is its own rollout.
"""

from rolltool.schema.columns import (
    DEFAULT_ENV,
    FORMAT_COLUMNS,
    ID_COLUMNS,
    MAX_ID,
    id_type_conflicts,
    token_format,
)
from rolltool.schema.rollouts import Rollouts, scan, scan_deferred

__all__ = [
    "DEFAULT_ENV",
    "FORMAT_COLUMNS",
    "ID_COLUMNS",
    "MAX_ID",
    "Rollouts",
    "id_type_conflicts",
    "scan",
    "scan_deferred",
    "token_format",
]
