"""What comes in: input files, folders and globs resolved to Parquet (`resolve`, reading through
`parquet`, with the conversion hints for other formats in `hints`) and realistic synthetic
rollouts (`synth`).
"""
