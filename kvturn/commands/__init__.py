"""The `kvturn` commands, one module per group; kvturn/cli.py puts them together."""
