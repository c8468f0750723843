"""The CLI's commands, one module each: its options and its body. cli.py registers them on the Typer app;
options.py holds the options several commands share, common.py the helpers they share."""
