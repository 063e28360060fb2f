"""Small helpers with no domain: number formatting, JSON-able values, the problem collector."""
