"""Command-line entry points (thin: parse, call the library, exit with a meaningful code)."""
