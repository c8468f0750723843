"""The bodies of CLI commands, one module each (cli.py declares the options and calls them)."""
