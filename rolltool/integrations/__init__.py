"""Drop-in replacements for trainers' own partitioning calls (no torch on the import path).

* ``verl``: ``get_seqlen_balanced_partitions`` and a list-level core of ``rearrange_micro_batches``
  with verl's signatures and return types, plus ``patch()`` to swap them into a running verl.
"""
