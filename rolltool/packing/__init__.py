"""The per-step unit of work below every engine (`step`) and the one manifest assembler
(`manifest`).
"""
