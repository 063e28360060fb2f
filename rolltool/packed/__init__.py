"""A packed directory as files: the writer (shards, samples.parquet, manifest last), the reader
(`open_packed`, integrity checks on open and on read) and its torch adapter (`torch_data`,
which depends on the reader, never the reverse).
"""
