"""Reading a plan's tokens from the input: the token reader with its bounded cache (`tokens`),
the plan's read amplification before any token is read (`readplan`), and the exchange's step
buckets for plans that scatter steps over the input (`buckets`).
"""
