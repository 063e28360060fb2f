"""What comes in: input files, folders and globs resolved to Parquet (`source`, with the
conversion hints for other formats) and realistic synthetic rollouts (`synth`).
"""
