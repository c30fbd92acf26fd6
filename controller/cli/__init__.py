"""The `autolab` command line: one explicit parser (main.py) over the front ends."""
