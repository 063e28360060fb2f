"""rolltool's version (recorded in every manifest and Parquet output)."""

__version__ = "0.1.0"
