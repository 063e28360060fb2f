"""Where bytes go: paths and URIs on any pyarrow filesystem (`fs`), atomic local outputs and
the `--force` rules (`outputs`), object-storage outputs committed by their manifest (`remote`).
"""
